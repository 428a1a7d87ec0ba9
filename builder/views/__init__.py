"""Views of an environment that every stage shares: what its code says (header, method sources, rules), its
state rendered for a prompt within a budget, the output type a model writes a state in, the one rule for what is
a collection of records, and the prompt budgets a too-long prompt shrinks through. Nothing here runs generated
code: code is read from the AST, states are plain JSON data."""
