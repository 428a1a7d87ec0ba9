"""Sizes of text builder stores or shows, in one place: what a rejection's detail keeps, what evidence keeps of a
tool's result. (Prompt budgets, which shrink with the model's context, are `builder.views.budget`'s.)"""

DETAIL_CHARS = 2000  # a rejection's detail, an error message kept in a record
RESULT_CHARS = 300  # a tool call's result kept as evidence, or quoted back to the model in a refusal
