"""What every stage shares: configs, storage, the Ray connection, logging and the CLI."""
