"""Generated environments: the contract and lint, tool schemas, sandboxed sessions, checks, trainer API."""
