"""Synthetic extraction workloads of two shapes, deterministic for a seed.

`invoices`: few long system prompts (a client's accounting policy, ~900 tokens), short invoices,
short outputs. `incidents`: many short system prompts (~200 tokens, one per team), longer
reports, longer outputs with a list. Documents arrive interleaved across prompts, as a mixed
nightly feed does.
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


INCIDENT_SCHEMA = {
    "type": "object",
    "properties": {
        "service": {"type": "string", "maxLength": 40},
        "severity": {"type": "string", "enum": ["sev1", "sev2", "sev3", "sev4"]},
        "started_at": {"type": "string", "maxLength": 25},
        "customer_impact": {"type": "boolean"},
        "root_cause": {"type": "string", "maxLength": 200},
        "actions": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 5},
        "summary": {"type": "string", "maxLength": 300},
    },
    "required": ["service", "severity", "started_at", "customer_impact", "root_cause", "actions", "summary"],
    "additionalProperties": False,
}
SERVICES = ["checkout", "search", "auth", "billing", "ingest", "mailer", "cdn", "payments", "ledger", "reports"]
SYMPTOMS = ("latency timeout error-rate saturation deadlock failover rollback retry-storm cache-miss "
            "certificate dns quota throttling replication-lag disk-full oom-kill").split()


def incident_prompt(i: int, words: int, rng: random.Random) -> str:
    """One team's short triage guide."""
    head = (f"You triage incident reports for on-call team {i:03d}. Extract service, severity, start time, "
            f"customer impact, root cause, follow-up actions and a summary as one JSON object.\n")
    rules = []
    while sum(len(r.split()) for r in rules) < words:
        w = rng.sample(SYMPTOMS, 3)
        rules.append(f"Team {i:03d} rates {w[0]} with {w[1]} as {rng.choice(['sev1', 'sev2', 'sev3'])} unless {w[2]} is resolved.")
    return head + " ".join(rules)


def incident(rng: random.Random) -> str:
    svc = rng.choice(SERVICES)
    lines = [f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {rng.choice(SYMPTOMS)} on {svc}: "
             + " ".join(rng.choice(SYMPTOMS + WORDS) for _ in range(rng.randint(6, 14))) for _ in range(rng.randint(6, 12))]
    return (f"INCIDENT {rng.randint(1000, 9999)} service={svc} opened 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}\n"
            + "\n".join(lines) + f"\nStatus: {rng.choice(['mitigated', 'resolved', 'monitoring'])}")


# name -> (system prompt maker, document maker, schema, prompts, words per prompt, max_tokens)
WORKLOADS = {
    "invoices": (system_prompt, document, SCHEMA, 64, 650, 128),
    "incidents": (incident_prompt, incident, INCIDENT_SCHEMA, 256, 140, 320),
}


def write_workload(out: Path, docs: int, prompts: int, prompt_words: int, seed: int = 1,
                   kind: str = "invoices") -> Path:
    """Write documents.parquet and schema.json under out; return the Parquet path."""
    make_prompt, make_doc, schema = WORKLOADS[kind][:3]
    rng = random.Random(seed)
    systems = [make_prompt(i, prompt_words, rng) for i in range(prompts)]
    rows = {"doc_id": [], "text": [], "system_prompt": []}
    for n in range(docs):
        rows["doc_id"].append(f"d{n:06d}")
        rows["text"].append(make_doc(rng))
        rows["system_prompt"].append(systems[rng.randrange(prompts)])  # arrival order: interleaved
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), out / "documents.parquet")
    (out / "schema.json").write_text(json.dumps(schema, indent=1))
    return out / "documents.parquet"
