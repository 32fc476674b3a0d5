"""meshforge.run: the training runtime: plan and launch, the trainer and its components
(step, optimizer, data, checkpoints, records, loggers, console, memory, FLOPs)."""
