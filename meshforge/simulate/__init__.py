"""meshforge.simulate: everything that plays a rank without devices, under torch's fake
process group (shardings, memory estimates, pipeline orders)."""
