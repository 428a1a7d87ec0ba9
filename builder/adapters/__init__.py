"""Adapters of a release's environments to RL frameworks other than TRL (whose adapter is
`builder.envs.trainer`): `builder.adapters.openenv` (an OpenEnv `Environment`) and `builder.adapters.verifiers`
(a `verifiers` taskset). Each needs its package: `pip install builder-envs[openenv]`, `builder-envs[verifiers]`."""
