"""meshforge.experiments: many runs at once: mesh-shape sweeps, and comparing runs offline."""
