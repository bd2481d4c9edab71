"""The command line and its jobs (run, layout, check, info, bench); built on the library."""
