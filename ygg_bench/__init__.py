"""Measurement: `ygg bench`, `ygg bench-serve`, their peers and reports, and the one harness
(`ygg_bench.harness`) that they and every script in benchmarks/ run on. Installed with the
toolchain; it imports the runtime and the toolchain, and neither imports it. Its commands
(`ygg_bench.cli`) join the runtime's `ygg` script through an entry point."""
