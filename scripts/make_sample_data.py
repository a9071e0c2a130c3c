"""Generate the sample input for jobs/summarize.yaml: realistic documents from five desks.

Each desk (support, reviews, news, IT incidents, meetings) has its own long system prompt, so the
runner's grouping and prefix caching have something to work with. Deterministic for a seed.

    python scripts/make_sample_data.py --rows 300 --out jobs/data/documents.parquet
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FIELDS = """
Return one JSON object with exactly these fields:
- "summary": one or two plain sentences, at most 240 characters, that say what happened and what is asked.
  Do not copy the first sentence of the document; do not add facts that are not in it.
- "category": one of "support", "review", "news", "incident", "meeting", "other".
- "sentiment": the writer's attitude: "positive", "neutral" or "negative".
- "urgency": an integer from 1 (no action needed) to 5 (act today: money, safety or many users at stake).
- "entities": up to four names of people, companies, products or places that the document names, as written.
Answer with the JSON object only: no preface, no markdown fences, no comments.
"""

DESKS = {
    "support": """You are the triage assistant of the Northwind Appliances customer-care desk.
Northwind sells kitchen appliances (blenders, kettles, toasters, espresso machines and stand mixers)
in twelve countries, through its web shop and through retail partners. Every day the desk receives
several thousand e-mails and chat transcripts. Your extractions feed the queue that decides which
agent sees a ticket first, so be precise about urgency: a burning smell, sparks, smoke, water
leaking near a plug or any injury is always urgency 5; a device dead on arrival or a double charge
is 4; a missing part or a late delivery is 3; a question about use or care is 2; praise is 1.
Treat refunds and chargebacks as money at stake. Customers often write angrily about small issues
and politely about serious ones: judge the facts, not the tone, for urgency, but report the tone as
sentiment. Product names follow the pattern NW-<family>-<number>, for example NW-Blend-400.
""",
    "review": """You are the review analyst of a consumer electronics marketplace.
Reviews arrive from verified buyers of headphones, smart speakers, e-readers, fitness trackers and
portable chargers. Merchandising teams use your extractions to spot failing batches early and to
quote good reviews. Category is always "review" unless the text is clearly not a product review.
Urgency measures how much the review signals a product problem that needs a merchant's attention:
a safety problem (overheating, swelling battery) is 5, a defect many buyers could share is 4, a
single unit failing is 3, a complaint about taste or price is 2, a happy review is 1.
Name the product and the brand in entities, and the seller when the buyer names one. Reviews mix
praise and complaints; the sentiment is the overall verdict, usually stated near the end or given
by the star rating in the text.
""",
    "news": """You are the briefing editor of a regional business news service.
Your readers are analysts who skim hundreds of short wire items a day. Summaries must be neutral and
factual, keep numbers exactly as written (amounts, percentages, dates) and never speculate.
Category is "news". Sentiment reflects the item's news for the company it is about: layoffs,
losses and recalls are negative; results in line with guidance are neutral; growth, contracts and
awards are positive. Urgency reflects how quickly a portfolio manager should read it: a profit
warning, a recall or a default is 5, an acquisition or a leadership change is 4, quarterly results
are 3, a product launch or a hire is 2, an award or a sponsorship is 1. Entities are the companies,
people and places named, most important first.
""",
    "incident": """You are the on-call assistant of the platform engineering team at Lumen Logistics.
Incident reports come from monitoring alerts, engineers' notes and status-page drafts about the
routing API, the warehouse scanners, the billing batch and the customer portal. Your extraction
opens or updates a ticket. Category is "incident". Urgency follows the severity policy: customer
data at risk or all customers down is 5; one region or one major service degraded is 4; an internal
tool down or a failed batch that can be re-run is 3; a warning that has not yet caused harm is 2; a
resolved incident reported for the record is 1. Sentiment is negative for ongoing problems,
neutral for status updates and positive only when a report says the problem is fully resolved.
Entities are services, hosts, regions and teams named in the report.
""",
    "meeting": """You are the note-taker's assistant for the product organisation of a mid-sized software
company. Inputs are raw meeting notes: stand-ups, planning sessions, customer calls and retros,
written quickly by whoever held the pen, with abbreviations and half sentences. Category is
"meeting". The summary states the decision taken or, if none, the open question and its owner.
Urgency reflects deadlines: a commitment due today or a customer escalation is 5, due this week is
4, due this month is 3, an idea with no date is 2, a purely informational meeting is 1. Sentiment
is the mood of the meeting as the notes convey it. Entities are people, customers and products.
""",
}

PEOPLE = ["Ana Ruiz", "Tom Becker", "Priya Nair", "Kenji Sato", "Lena Novak", "Omar Haddad", "Grace Kim",
          "Marco Rossi", "Sofia Lind", "David Okafor", "Chloe Martin", "Ivan Petrov"]
CITIES = ["Lisbon", "Leeds", "Austin", "Osaka", "Gdansk", "Nairobi", "Toronto", "Lyon", "Porto", "Denver"]
COMPANIES = ["Helios Grid", "Brightwater Foods", "Kestrel Motors", "Orbis Pharma", "Tidal Bank",
             "Juniper Air", "Copperline Mining", "Vela Telecom"]
APPLIANCES = ["NW-Blend-400", "NW-Kettle-220", "NW-Toast-310", "NW-Espresso-900", "NW-Mix-650"]
GADGETS = [("Aurora", "NC700 headphones"), ("Pulse", "Band 3 fitness tracker"), ("Quill", "Paper 6 e-reader"),
           ("Volt", "PowerCube 20000 charger"), ("Echo Ridge", "Mini smart speaker")]
SERVICES = ["routing-api", "scanner-gateway", "billing-batch", "customer-portal", "auth-service"]
REGIONS = ["eu-west", "us-east", "ap-south", "eu-central"]


def _support(r: random.Random) -> tuple[str, str]:
    who, product, days = r.choice(PEOPLE), r.choice(APPLIANCES), r.randint(1, 40)
    problem = r.choice([
        f"it started to smell like burning plastic after {days} days and the cord got hot",
        "it arrived with a cracked jug and will not switch on at all",
        f"I was charged twice for order {r.randint(100000, 999999)} and nobody answers my e-mails",
        "the delivery is now two weeks late and the tracking page has not changed",
        "the lid seal is missing from the box",
        "how do I descale it? the manual only shows pictures",
        "it works beautifully and I wanted to thank the technician who helped me",
    ])
    tone = r.choice(["This is unacceptable.", "Could you please help?", "Thanks in advance.", "I am very disappointed.",
                     "No rush, just curious."])
    body = (f"Hello, my name is {who} from {r.choice(CITIES)}. I bought the {product} in "
            f"{r.choice(['March', 'June', 'September', 'November'])} from your web shop and {problem}. "
            f"{tone} I have owned Northwind products for {r.randint(1, 12)} years. "
            f"Please reply to this address or call me after {r.randint(4, 8)} pm.")
    return f"Ticket about {product}", body


def _review(r: random.Random) -> tuple[str, str]:
    brand, product = r.choice(GADGETS)
    stars = r.randint(1, 5)
    good = r.choice(["the sound is rich", "battery life is excellent", "setup took two minutes",
                     "it is very light", "the screen is sharp even in sunlight"])
    bad = r.choice(["the case gets hot while charging", "it disconnects every few minutes",
                    "the strap broke after a month", "it is overpriced for what it does",
                    "the battery swelled and the case cracked", "nothing, honestly"])
    body = (f"{stars} stars. I bought the {brand} {product} from {r.choice(['ShopNest', 'Gadgetry', 'the brand store'])} "
            f"{r.randint(1, 9)} weeks ago. On the plus side, {good}. On the minus side, {bad}. "
            f"{'I would buy it again.' if stars >= 4 else 'I would not recommend it.' if stars <= 2 else 'It is fine for the price.'}")
    return f"Review of {brand} {product}", body


def _news(r: random.Random) -> tuple[str, str]:
    co, city, pct = r.choice(COMPANIES), r.choice(CITIES), r.randint(2, 35)
    event = r.choice([
        f"reported third-quarter revenue up {pct}% to {r.randint(120, 990)} million euros, in line with guidance",
        f"issued a profit warning, cutting its full-year outlook by {pct}%",
        f"agreed to acquire {r.choice(COMPANIES)} for {r.randint(1, 9)}.{r.randint(0, 9)} billion dollars",
        f"announced {r.randint(80, 1200)} job cuts at its {city} plant",
        f"named {r.choice(PEOPLE)} as chief executive, effective {r.choice(['January', 'April', 'July'])} 1",
        f"recalled {r.randint(5, 90)},000 units after reports of faulty wiring",
        f"won a {r.randint(20, 400)} million contract to supply the city of {city}",
    ])
    body = (f"{city}, {r.randint(1, 28)} {r.choice(['May', 'October', 'December'])} — {co} {event}. "
            f"Shares {'rose' if r.random() > 0.5 else 'fell'} {r.randint(1, 12)}% in early trading. "
            f"Analysts at {r.choice(['Morrow & Co', 'Fenwick Research', 'Baltic Capital'])} said the move "
            f"{r.choice(['was expected', 'surprised the market', 'raises questions about debt'])}.")
    return f"{co}: wire item", body


def _incident(r: random.Random) -> tuple[str, str]:
    svc, region = r.choice(SERVICES), r.choice(REGIONS)
    what = r.choice([
        f"error rate on {svc} in {region} at {r.randint(5, 60)}% since {r.randint(0, 23):02d}:{r.randint(0, 59):02d} UTC",
        f"{svc} fully down in all regions; customers cannot log in",
        f"disk usage on {svc}-db-{r.randint(1, 9)} at 91%, no impact yet",
        f"nightly {svc} job failed at step {r.randint(2, 7)}; safe to re-run",
        f"resolved: latency on {svc} back to normal after rollback of release {r.randint(100, 999)}",
        f"possible exposure of customer addresses through a debug endpoint on {svc}",
    ])
    body = (f"[{r.choice(['ALERT', 'NOTE', 'UPDATE'])}] {what}. Reported by {r.choice(PEOPLE)} "
            f"(team {r.choice(['Atlas', 'Harbor', 'Nimbus'])}). Runbook {svc.upper()}-{r.randint(1, 30)} "
            f"{r.choice(['followed', 'not yet followed', 'does not cover this'])}. Next update in {r.randint(15, 60)} minutes.")
    return f"{svc} {region}", body


def _meeting(r: random.Random) -> tuple[str, str]:
    a, b = r.sample(PEOPLE, 2)
    topic = r.choice(["Q3 roadmap", "onboarding flow", "pricing page", "mobile release", "SSO for enterprise"])
    outcome = r.choice([
        f"decided to ship the {topic} behind a flag on Friday; {a} owns the rollout",
        f"no decision on the {topic}; {b} to collect data by end of month",
        f"customer {r.choice(COMPANIES)} escalated about the {topic}, {a} to call them today",
        f"retro: {topic} went well, team happy, nothing to action",
        f"idea from {b}: rebuild the {topic} later, no date",
    ])
    body = (f"Notes {r.choice(['standup', 'planning', 'customer call', 'retro'])} — attendees {a}, {b}, "
            f"{r.choice(PEOPLE)}. Discussed {topic}. {outcome}. AOB: {r.choice(['none', 'offsite dates', 'hiring update'])}.")
    return f"Meeting: {topic}", body


MAKERS = {"support": _support, "review": _review, "news": _news, "incident": _incident, "meeting": _meeting}


def make_table(rows: int, seed: int) -> pa.Table:
    r = random.Random(seed)
    desks = list(DESKS)
    cols: dict[str, list] = {"doc_id": [], "source": [], "title": [], "body": [], "system_prompt": []}
    for i in range(rows):
        desk = r.choice(desks)
        title, body = MAKERS[desk](r)
        cols["doc_id"].append(f"doc-{i + 1:05d}")
        cols["source"].append(desk)
        cols["title"].append(title)
        cols["body"].append(body)
        cols["system_prompt"].append(DESKS[desk].strip() + "\n" + FIELDS.strip())
    return pa.table(cols)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "jobs/data/documents.parquet")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table = make_table(args.rows, args.seed)
    pq.write_table(table, args.out, row_group_size=64)
    print(f"wrote {table.num_rows} rows to {args.out}")


if __name__ == "__main__":
    main()
