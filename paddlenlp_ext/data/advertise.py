"""Deterministic attribute -> advertising-text data set (the docs' AdvertiseGen task, in English).

The bundled demo data (``llm/data/advertise``) is made by this module, so it
needs no download and a tiny model visibly learns it: the text is a function
of the attributes plus a template choice.

>>> ex = make_example(__import__("random").Random(0))
>>> sorted(ex)
['src', 'tgt']
"""

import json
import os
import random
from typing import Dict, List

TYPES = ["dress", "shirt", "skirt", "jacket", "coat", "sweater", "jeans", "hoodie"]
COLORS = ["red", "blue", "black", "white", "green", "pink", "gray", "yellow"]
STYLES = {
    "casual": "easy weekends and relaxed days out",
    "elegant": "dinners, weddings and evening events",
    "fresh": "bright spring mornings",
    "sporty": "the gym, the park and every active day",
    "vintage": "anyone who loves a classic retro look",
    "minimalist": "a clean and simple wardrobe",
}
MATERIALS = {
    "cotton": "soft, breathable cotton",
    "silk": "smooth, light silk",
    "denim": "sturdy, washed denim",
    "wool": "warm, cozy wool",
    "linen": "cool, airy linen",
}
PATTERNS = {
    "plain": "a plain finish that matches everything",
    "striped": "classic stripes that add a sharp touch",
    "floral": "a floral print that feels lively and sweet",
    "checked": "a checked pattern with a smart look",
}
FITS = {"loose": "a loose cut that moves with you", "slim": "a slim cut that flatters the figure",
        "regular": "a regular cut that fits most body types"}

TEMPLATES = [
    "This {color} {type} in {material_text} brings a {style} feel. It has {fit_text} and {pattern_text}. "
    "Perfect for {style_text}.",
    "Meet the {style} {color} {type}: made of {material_text}, with {pattern_text}. "
    "Thanks to {fit_text}, it is ideal for {style_text}.",
]


def make_example(rng: random.Random) -> Dict[str, str]:
    attrs = {
        "type": rng.choice(TYPES),
        "color": rng.choice(COLORS),
        "style": rng.choice(sorted(STYLES)),
        "material": rng.choice(sorted(MATERIALS)),
        "pattern": rng.choice(sorted(PATTERNS)),
        "fit": rng.choice(sorted(FITS)),
    }
    src = "*".join(f"{k}#{v}" for k, v in attrs.items())
    tgt = rng.choice(TEMPLATES).format(
        **attrs,
        material_text=MATERIALS[attrs["material"]],
        pattern_text=PATTERNS[attrs["pattern"]],
        fit_text=FITS[attrs["fit"]],
        style_text=STYLES[attrs["style"]],
    )
    return {"src": src, "tgt": tgt}


def make_dataset(n_train: int = 2000, n_dev: int = 64, seed: int = 42) -> Dict[str, List[Dict[str, str]]]:
    rng = random.Random(seed)
    return {
        "train": [make_example(rng) for _ in range(n_train)],
        "dev": [make_example(rng) for _ in range(n_dev)],
    }


def write_dataset(out_dir: str, n_train: int = 2000, n_dev: int = 64, seed: int = 42) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for split, rows in make_dataset(n_train, n_dev, seed).items():
        with open(os.path.join(out_dir, f"{split}.json"), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
