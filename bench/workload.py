"""A synthetic extraction workload: many distinct long system prompts, short documents, a JSON schema.

Documents arrive interleaved across prompts, as a mixed nightly feed does. Deterministic for a seed.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "maxLength": 60},
        "total": {"type": "number"},
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
        "due_date": {"type": "string", "maxLength": 20},
        "category": {"type": "string", "enum": ["software", "hardware", "services", "travel", "other"]},
        "summary": {"type": "string", "maxLength": 160},
    },
    "required": ["vendor", "total", "currency", "due_date", "category", "summary"],
    "additionalProperties": False,
}

WORDS = ("ledger invoice vendor approval threshold quarter audit policy region budget contract renewal "
         "discount freight customs warranty license seat subscription travel lodging per-diem receipt "
         "tax exemption reverse-charge cost-center project milestone retainer penalty escrow").split()
VENDORS = ["Acme Tools", "Borealis Cloud", "Cobalt Freight", "Delta Office", "Everlight Energy", "Fjord Travel",
           "Granite Legal", "Helix Labs", "Ion Networks", "Juno Print"]


def system_prompt(i: int, words: int, rng: random.Random) -> str:
    """A long, distinct instruction: a client's own extraction policy."""
    head = (f"You extract invoice fields for client #{i:03d}. Follow this client's accounting policy exactly. "
            f"Answer with one JSON object with the fields vendor, total, currency, due_date, category and summary.\n")
    rules = []
    while sum(len(r.split()) for r in rules) < words:
        w = rng.sample(WORDS, 6)
        rules.append(f"Rule {len(rules) + 1}: when the {w[0]} mentions {w[1]} or {w[2]}, record the {w[3]} "
                     f"under the {w[4]} of client #{i:03d}, never under {w[5]}.")
    return head + "\n".join(rules)


def document(rng: random.Random) -> str:
    vendor = rng.choice(VENDORS)
    amount = rng.randint(40, 90000) + rng.randint(0, 99) / 100
    cur = rng.choice(["EUR", "USD", "GBP", "JPY"])
    lines = [f"{rng.choice(WORDS)} {rng.choice(WORDS)} x{rng.randint(1, 20)} @ {rng.randint(5, 900)}.00"
             for _ in range(rng.randint(3, 8))]
    return (f"INVOICE {rng.randint(10000, 99999)} from {vendor}\nDate: 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}\n"
            f"Due: 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}\n" + "\n".join(lines) +
            f"\nTOTAL {amount:.2f} {cur}\nNotes: {' '.join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))}")


def write_workload(out: Path, docs: int, prompts: int, prompt_words: int, seed: int = 1) -> Path:
    """Write documents.parquet and schema.json under out; return the Parquet path."""
    rng = random.Random(seed)
    systems = [system_prompt(i, prompt_words, rng) for i in range(prompts)]
    rows = {"doc_id": [], "text": [], "system_prompt": []}
    for n in range(docs):
        rows["doc_id"].append(f"d{n:06d}")
        rows["text"].append(document(rng))
        rows["system_prompt"].append(systems[rng.randrange(prompts)])  # arrival order: interleaved
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), out / "documents.parquet")
    (out / "schema.json").write_text(json.dumps(SCHEMA, indent=1))
    return out / "documents.parquet"
