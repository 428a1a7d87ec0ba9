"""What the model drafts for a plan, the deterministic clean-up of those drafts, and the plan's validation rules.

Drafts are what the model answers (two small requests: the state, then the operations). Clean-up only does
what cannot change meaning (snake_case names, type synonyms such as "string" -> "str"); everything else is a
validation error with a message that says what to change, fed back to the model by `builder.stages.plan`.
"""

from __future__ import annotations

import keyword
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field

from builder.envs.lint import CLOCK_ADVICE, RESERVED_TOOLS, clock_parameter
from builder.naming import snake_case
from builder.records import EntityPlan, OperationPlan, PlanType

SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")
PASCAL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
MAX_NAME = 48
MAX_ENTITIES = 8
KEY_TYPES = ("str", "int")

# Words in an attribute's name that say a person knows the value and would name a record by it ("the member
# Ada Palmer", "order 1042", "the book Dune"); an entity with such an attribute needs a tool that finds it by it.
USER_FACING_WORDS = frozenset(
    "name title email phone mobile number code label username handle plate sku isbn barcode serial reference"
    " vin".split()
)
# Words that make such a name describe a record rather than name it (`postal_code`, `status_code`, `type_name`).
DESCRIPTIVE_WORDS = frozenset("postal zip country currency status reason area language error type".split())
# Parameters of a free-text search, which count as matching any user-facing attribute of what the query reads.
SEARCH_PARAMETERS = frozenset("query search keyword keywords q term search_term search_text text".split())

_TYPE_SYNONYMS = {
    "string": "str", "text": "str", "date": "str", "datetime": "str", "time": "str", "uuid": "str", "id": "str",
    "integer": "int", "long": "int", "number": "float", "double": "float", "decimal": "float",
    "boolean": "bool", "object": "dict", "map": "dict", "json": "dict", "dictionary": "dict",
    "list": "list[str]", "array": "list[str]",
}  # fmt: skip
_KIND_SYNONYMS = {"read": "query", "get": "query", "state_change": "change", "write": "change", "update": "change"}


def pascal_case(text: str) -> str:
    """`"hotel booking"` or `hotel_booking` -> `HotelBooking`; an existing PascalCase name is kept."""
    if PASCAL.match(text.strip()):
        return text.strip()
    return "".join(word[:1].upper() + word[1:] for word in snake_case(text).split("_"))


def class_name_for(text: str) -> str:
    """The environment class name: PascalCase ending in `Env` (builder's convention for environment classes)."""
    name = pascal_case(text)
    return name if name.endswith("Env") else f"{name}Env"


def normal_type(value: Any) -> Any:
    """Map common type spellings onto `PlanType` (`string` -> str, `List[int]` -> list[int]); others pass."""
    if not isinstance(value, str):
        return value
    text = re.sub(r"\s+", "", value).casefold().replace("typing.", "")
    text = re.sub(r"^optional\[(.*)\]$", r"\1", text)
    outer = re.match(r"^(list|array|sequence)\[(.*)\]$", text)
    if outer:
        inner = _TYPE_SYNONYMS.get(outer.group(2), outer.group(2))
        return f"list[{'dict' if inner.startswith('dict') else inner}]"
    if text.startswith("dict[") or text.startswith("mapping"):
        return "dict"
    return _TYPE_SYNONYMS.get(text, text)


def normal_kind(value: Any) -> Any:
    return _KIND_SYNONYMS.get(value.strip().casefold(), value.strip().casefold()) if isinstance(value, str) else value


DraftType = Annotated[PlanType, BeforeValidator(normal_type)]


# List caps also go into the JSON schema, so constrained decoding cannot run away generating items until the
# token budget cuts the JSON off; the operation count is checked by validation, since its bounds are config.
# String caps do the same for text: a small model looping inside a description must close the string.
Name = Annotated[str, Field(max_length=MAX_NAME)]  # the identifier rule below, enforced while decoding
Sentence = Annotated[str, Field(max_length=300)]


class AttributeDraft(BaseModel):
    name: Name
    type: DraftType
    description: str = Field("", max_length=300)


class EntityDraft(BaseModel):
    name: Name = Field(description="snake_case singular, e.g. member")
    key: Name = Field(description="the attribute that identifies a record, e.g. member_id")
    attributes: list[AttributeDraft] = Field(max_length=16)


class StateDraft(BaseModel):
    """The first half of a plan: what the environment stores and the rules it keeps."""

    class_name: Name = Field(description="PascalCase ending in Env, e.g. LibraryLoansEnv")
    description: str = Field(max_length=600)
    entities: list[EntityDraft] = Field(max_length=MAX_ENTITIES)
    rules: list[Sentence] = Field(max_length=12, description="business rules and constraints, one sentence each")


class ParameterDraft(BaseModel):
    name: Name
    type: DraftType
    description: str = Field("", max_length=300)
    required: bool = True


class OperationDraft(BaseModel):
    name: Name = Field(description="snake_case verb phrase, e.g. borrow_book")
    kind: Annotated[Literal["query", "change"], BeforeValidator(normal_kind)]
    description: str = Field(max_length=400)
    parameters: list[ParameterDraft] = Field(max_length=10)
    returns: Sentence = Field(description="what the result holds on success")
    enforces: list[int] = Field(max_length=12, description="numbers of the rules it enforces")
    reads: list[Name] = Field(max_length=MAX_ENTITIES, description="entities it reads")
    writes: list[Name] = Field(max_length=MAX_ENTITIES, description="entities it changes; empty for a query")


class OperationsDraft(BaseModel):
    """The second half of a plan: the tools, split into queries and state changes."""

    operations: list[OperationDraft]


def plural(word: str) -> str:
    """The collection name of an entity: member -> members, category -> categories, address -> addresses."""
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word  # already plural
    if word.endswith("y") and len(word) > 1 and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    if word.endswith(("s", "x", "z", "ch", "sh")):
        return word + "es"
    return word + "s"


def clean_state(draft: StateDraft, topic_name: str) -> StateDraft:
    """Names to snake_case (class name to PascalCase+Env, from the topic when empty), text trimmed."""
    entities = [
        EntityDraft(
            name=snake_case(entity.name),
            key=snake_case(entity.key),
            attributes=[
                attribute.model_copy(update={"name": snake_case(attribute.name)}) for attribute in entity.attributes
            ],
        )
        for entity in draft.entities
    ]
    return StateDraft(
        class_name=class_name_for(draft.class_name or topic_name),
        description=" ".join(draft.description.split()),
        entities=entities,
        rules=[" ".join(rule.split()) for rule in draft.rules if rule.strip()],
    )


def clean_operations(draft: OperationsDraft, entities: list[EntityPlan]) -> OperationsDraft:
    """Names to snake_case; entity references by collection name (`members`) mapped to the entity (`member`)."""
    by_collection = {entity.collection: entity.name for entity in entities}

    def entity_ref(text: str) -> str:
        name = snake_case(text)
        return by_collection.get(name, name)

    operations = [
        op.model_copy(
            update={
                "name": snake_case(op.name),
                "description": " ".join(op.description.split()),
                "parameters": [p.model_copy(update={"name": snake_case(p.name)}) for p in op.parameters],
                "reads": list(dict.fromkeys(entity_ref(r) for r in op.reads if r.strip())),
                "writes": list(dict.fromkeys(entity_ref(w) for w in op.writes if w.strip())),
            }
        )
        for op in draft.operations
    ]
    return OperationsDraft(operations=operations)


def entity_plans(state: StateDraft) -> list[EntityPlan]:
    return [
        EntityPlan(
            name=entity.name,
            key=entity.key,
            attributes=tuple(attribute.model_dump() for attribute in entity.attributes),
            collection=plural(entity.name),
        )
        for entity in state.entities
    ]


def operation_plans(draft: OperationsDraft) -> list[OperationPlan]:
    return [OperationPlan.model_validate(op.model_dump()) for op in draft.operations]


def _name_error(where: str, name: str, style: str = "snake_case") -> str | None:
    pattern = PASCAL if style == "PascalCase" else SNAKE
    if not name:
        return f"{where}: the name is empty"
    if not pattern.match(name) or keyword.iskeyword(name) or len(name) > MAX_NAME:
        return f"{where}: {name!r} is not a valid {style} Python identifier (at most {MAX_NAME} characters)"
    return None


def state_errors(state: StateDraft) -> list[str]:
    """Every problem of the state half; empty means valid. Messages say what to change."""
    errors = [e for e in [_name_error("class_name", state.class_name, "PascalCase")] if e]
    if not state.description:
        errors.append("description: describe what the environment manages in one or two sentences")
    if not 1 <= len(state.entities) <= MAX_ENTITIES:
        errors.append(f"entities: plan between 1 and {MAX_ENTITIES} entities (got {len(state.entities)})")
    if not state.rules:
        errors.append("rules: state at least one business rule or constraint the operations must enforce")
    seen: set[str] = set()
    for i, entity in enumerate(state.entities):
        where = f"entities[{i}] ({entity.name})"
        errors += [e for e in [_name_error(f"{where}.name", entity.name)] if e]
        if entity.name in seen or plural(entity.name) in {plural(s) for s in seen}:
            errors.append(f"{where}: the entity {entity.name!r} is planned twice; merge the two")
        seen.add(entity.name)
        names = [attribute.name for attribute in entity.attributes]
        if not names:
            errors.append(f"{where}: give it attributes, including its key")
        for j, attribute in enumerate(entity.attributes):
            errors += [e for e in [_name_error(f"{where}.attributes[{j}].name", attribute.name)] if e]
        for duplicate in sorted({name for name in names if names.count(name) > 1}):
            errors.append(f"{where}: the attribute {duplicate!r} appears more than once")
        key = next((a for a in entity.attributes if a.name == entity.key), None)
        if key is None:
            errors.append(f"{where}: the key {entity.key!r} must be one of its attributes: {', '.join(names)}")
        elif key.type not in KEY_TYPES:
            errors.append(f"{where}: the key {entity.key!r} must have type str or int, not {key.type}")
    return errors


def operation_errors(
    draft: OperationsDraft, entities: list[EntityPlan], rules: int, min_operations: int, max_operations: int
) -> list[str]:
    """Every problem of the operations half, checked against the (valid) state half; empty means valid."""
    ops = draft.operations
    errors: list[str] = []
    if not min_operations <= len(ops) <= max_operations:
        errors.append(f"operations: plan between {min_operations} and {max_operations} operations (got {len(ops)})")
    kinds = {op.kind for op in ops}
    for kind in ("query", "change"):
        if kind not in kinds:
            errors.append(f"operations: plan at least one {kind} operation")
    names = [op.name for op in ops]
    for duplicate in sorted({name for name in names if names.count(name) > 1}):
        errors.append(f"operations: the name {duplicate!r} is used more than once; names must be unique")
    known = {entity.name for entity in entities}
    collections = {entity.collection for entity in entities}
    entity_list = ", ".join(sorted(known))
    for i, op in enumerate(ops):
        where = f"operations[{i}] ({op.name})"
        errors += _operation_errors(where, op, known, collections, entity_list, rules)
    return errors + lookup_errors(ops, entities)


def user_facing(entity: EntityPlan, others: list[str] = ()) -> list[str]:
    """The attributes a user names a record by: `str` attributes, not the key nor a reference (`*_id`), whose
    name holds a word of `USER_FACING_WORDS` (`name`, `full_name`, `title`, `email`, `phone_number`, `sku`) and
    none of `DESCRIPTIVE_WORDS`. A copy of another entity's attribute (`customer_name` on an order, when
    `customer` is among `others`) names that other record, which is found through its own lookup."""
    copies = tuple(f"{other}_" for other in others if other != entity.name)
    return [
        attribute.name
        for attribute in entity.attributes
        if attribute.type == "str"
        and attribute.name != entity.key
        and not attribute.name.endswith(("_id", "_ids"))
        and not (copies and attribute.name.startswith(copies))
        and _user_words(attribute.name)
        and not set(attribute.name.split("_")) & DESCRIPTIVE_WORDS
    ]


def user_facing_key(entity: EntityPlan) -> bool:
    """Whether the key itself is what a user says (`order_number`, `email`, `sku`), not an internal `*_id`."""
    return not entity.key.endswith("_id") and bool(_user_words(entity.key))


def _user_words(name: str) -> set[str]:
    return set(name.split("_")) & USER_FACING_WORDS


def finds(op: OperationDraft, entity: EntityPlan, attributes: list[str]) -> bool:
    """Whether query `op` lets an agent find a record of `entity` from what a user says: it reads the entity and
    takes a parameter matching a user-facing attribute (sharing its word: `name` for `full_name`, or a free-text
    `query`/`search`/`keyword`), or it lists the entity's records with no required parameter."""
    if op.kind != "query" or entity.name not in op.reads:
        return False
    if not any(p.required for p in op.parameters):
        return True
    wanted = set().union(*(_user_words(attribute) for attribute in attributes))
    return any(p.name in SEARCH_PARAMETERS or _user_words(p.name) & wanted for p in op.parameters)


def lookup_errors(ops: list[OperationDraft], entities: list[EntityPlan]) -> list[str]:
    """One error per entity a user would name (by a user-facing attribute) that no query finds by it.

    An entity whose key is itself user-facing (`order_number`, `email`) is found by its key, and one with no
    user-facing attribute of its own (a log, a line item with a `product_name`) is reached through what refers
    to it: both need no lookup.
    """
    errors = []
    names = [entity.name for entity in entities]
    for entity in entities:
        attributes = user_facing(entity, names)
        if not attributes or user_facing_key(entity) or any(finds(op, entity, attributes) for op in ops):
            continue
        by = " or ".join(attributes)
        first = attributes[0]
        errors.append(
            f"{entity.name}: no query operation finds a {entity.name} by its {by}; users name a {entity.name}"
            f" that way, not by {entity.key}; add a query operation that finds a {entity.name} by {first}, e.g."
            f" find_{entity.collection}({first}: str) -> list of matching {entity.collection}"
            f" (reads: [{entity.name}]), or one that lists all {entity.collection} with no required parameter"
        )
    return errors


def _operation_errors(
    where: str, op: OperationDraft, known: set[str], collections: set[str], entity_list: str, rules: int
) -> list[str]:
    errors = [e for e in [_name_error(f"{where}.name", op.name)] if e]
    if op.name in RESERVED_TOOLS:
        errors.append(f"{where}: {op.name!r} is reserved for the runtime; choose another name")
    if op.name in collections:
        errors.append(f"{where}: {op.name!r} is also the name of a state attribute; name the tool with a verb")
    if not op.description:
        errors.append(f"{where}: describe what the operation does")
    params = [p.name for p in op.parameters]
    for j, name in enumerate(params):
        if name == "self":
            errors.append(f"{where}.parameters[{j}]: 'self' cannot be a parameter name")
        else:
            errors += [e for e in [_name_error(f"{where}.parameters[{j}].name", name)] if e]
    for duplicate in sorted({name for name in params if params.count(name) > 1}):
        errors.append(f"{where}: the parameter {duplicate!r} appears more than once")
    for j, parameter in enumerate(op.parameters):
        if clock_parameter(parameter.name, parameter.description):
            errors.append(
                f"{where}.parameters[{j}] ({parameter.name}) carries the current date or time: {CLOCK_ADVICE}"
            )
    for field, refs in (("reads", op.reads), ("writes", op.writes)):
        for ref in refs:
            if ref not in known:
                errors.append(f"{where}.{field}: {ref!r} is not a planned entity; use one of: {entity_list}")
    if op.kind == "change" and not op.writes:
        errors.append(f"{where}: a change must write state; list the entities it modifies in `writes` ({entity_list})")
    if op.kind == "query" and op.writes:
        errors.append(f"{where}: a query must not write state; empty `writes` or make it a change")
    for number in op.enforces:
        if not 1 <= number <= rules:
            errors.append(f"{where}.enforces: {number} is not a rule number (rules are numbered 1 to {rules})")
    return errors
