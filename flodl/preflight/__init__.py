"""The checks before any rank starts: every config and file check (`checks`), the task's parts built once
(`task_probe`), and `plan=true`'s summary (`plan`). Nothing here starts a rank."""
