"""The training loop and its parts: forward/backward, the step, optimizer, loss scale, guards, evaluation."""
