"""Measurement: `ygg bench`, `ygg bench-serve`, their peers and reports, and the one harness
(`ygg_bench.harness`) that they and every script in benchmarks/ run on. Installed with the
toolchain; it imports the runtime and the toolchain, and neither imports it. Its command line
(`ygg_bench.cli`) is the `ygg` script: every command, the runtime's and the toolchain's too."""
