"""Random JSON schemas for structured-output tests (seeded: the same schemas every run)."""

import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 fields: string, integer, number, boolean, enum, array, nested object."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    props = {}
    for n in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            props[f"s{n}"] = {"type": "string", "maxLength": rng.randint(1, 8)}
        elif kind == "integer":
            props[f"i{n}"] = {"type": "integer", "minimum": -50, "maximum": 5000}
        elif kind == "number":
            props[f"x{n}"] = {"type": "number"}
        elif kind == "boolean":
            props[f"b{n}"] = {"type": "boolean"}
        elif kind == "enum":
            props[f"e{n}"] = {"enum": rng.sample(["red", "green", "blue", "cyan", "teal"], rng.randint(1, 3))}
        elif kind == "array":
            props[f"a{n}"] = {"type": "array", "items": {"type": rng.choice(["integer", "boolean"])}, "maxItems": 3}
        else:
            props[f"o{n}"] = random_schema(rng, depth + 1)
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
