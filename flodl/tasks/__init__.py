"""Built-in tasks: model, dataset, loss and eval function for the default runs."""
