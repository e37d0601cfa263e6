"""Built-in tasks (digits, the default; npy_blobs; resnet; gpt): model, dataset, loss and eval function,
named by the `conf/task/` configs."""
