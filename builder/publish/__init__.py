"""Export the store to a release folder in Hub layout, and publish it as a versioned dataset.

Modules: `export` (store → Parquet shards), `card` and `plots` (the dataset card), `release` (versions, manifest,
changelog), `backends` (local git Hub, real Hub), `publish` (the command), `server` (olah over the local Hub),
`loading` (pinned loads for trainers). Importing this package has no side effects.
"""
