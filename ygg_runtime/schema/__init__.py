"""The plan's schema, at the bottom of the runtime: every layer may read it, it imports none of them.
`plan` (plan.yaml as typed dataclasses), `params` (each method's parameters) and `typed` (the typed
reading both use). No torch: the command line reads a plan before it loads anything."""
