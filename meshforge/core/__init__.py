"""meshforge.core: leaves every layer may use (errors, units, seeding, topology); they import
nothing else of meshforge."""
