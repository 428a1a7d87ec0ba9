"""builder: mass-produce executable, stateful, tool-interactive environments for training LLM agents."""

__version__ = "0.1.0"
