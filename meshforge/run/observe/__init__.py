"""What a run reports: run.json, the loggers and W&B file reader, the terminal, figures, memory, FLOPs."""
