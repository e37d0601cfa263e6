"""What travels between ranks: messages, mailboxes over the rendezvous store, process groups, heartbeats."""
