"""Starting a traced command: the launcher, its watchdog, and the zero-edit start-up (inject/)."""
