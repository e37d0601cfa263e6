"""The run's configuration: the schema, its rules (pure), the host probe and the policy facts."""
