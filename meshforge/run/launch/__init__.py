"""Before and around training: the dry-run plan, the machine check, process groups, the local launcher."""
