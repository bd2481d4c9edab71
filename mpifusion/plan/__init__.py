"""Pure planning: layouts and grouping, no MPI and no arrays (runs anywhere, instantly)."""
