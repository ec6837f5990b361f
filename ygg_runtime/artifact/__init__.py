"""Loading an artifact (`load`: `ygg_runtime.load`), the runtime's composition root: it reads the plan
(`ygg_runtime.schema`), runs the checks (`ygg_runtime.checks`), builds the models and their runners and
the `Decoder` over them. Nothing below it imports it."""
