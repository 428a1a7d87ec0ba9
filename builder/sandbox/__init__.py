"""The isolation runtime: a pre-warmed zygote forks one hardened worker per episode (see docs/sandbox.md)."""
