"""The models: the shelf, each model's entry and sessions, its worker client, launching."""
