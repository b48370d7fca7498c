"""The plan document (`autoshard.plan/1`), the strategy in words and the cost breakdown."""
