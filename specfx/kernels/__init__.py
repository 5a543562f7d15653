"""Kernels specfx compiles into its graphs where Inductor's own are slower (see each module)."""
