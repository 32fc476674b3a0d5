"""A rank's own setup, below everything that runs in it: the process group and devices, the
plan (memory and machine checks before a launch), the analytic estimate, what the environment
says. The launcher (run/launch/) sits on top of the trainer; nothing here imports either."""
