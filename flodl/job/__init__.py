"""The running job: one rank assembled for its policy (`assembly`, `settings`), every rank's body (`rank`),
the run's host (`host`: coordinator, records, the run's end), which checkpoint the ranks continue from
(`resume`), and the ranks' failure records (`failures`)."""
