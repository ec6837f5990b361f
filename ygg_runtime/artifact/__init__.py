"""The artifact: its plan's schema (`plan`, with the methods' parameters in `params` and the typed
reading both use in `typed`), the checks it must pass on this machine (`integrity`: files, machine,
memory; `exactness`: whether the row check's guarantee holds here), and loading it (`load`:
`ygg_runtime.load`). This file imports none of them: the command line reads a plan without torch
(`ygg_runtime.artifact.plan`), while loading imports the models."""
