"""The chat requests of benchmarks/speculative.py, generated from a seed: no downloads, same seed, same requests.

Each workload imitates traffic where speculative decoding is expected to help (the answer copies spans of the
prompt) or not (the control):

- code_edit: an IDE assistant's "apply this edit" request (as in Cursor/Aider-style edit prompts): a ~60-line
  generated Python function (docstring, loops, branches, try/except, a return dict) and an instruction to rename
  a local variable or add a parameter, answered with the whole edited function: most of it copied.
- json_extract: document-to-JSON extraction (invoices, contracts): a few generated paragraphs with companies,
  people, dates, amounts and a reference number, plus distractors, and an instruction to return a JSON object
  whose values are copied verbatim from the document.
- tool_loop: the turn after a tool call in an agent loop: system prompt, the user's question, the assistant's
  call and the tool's JSON result (flights, an order, a forecast, a customer record), rendered as this gateway
  renders tool history for a chat template without tools (gateway/tools/prompt.py, `plain_messages`), so vLLM
  sees the same prompt; the answer repeats spans of the result.
- chat: the control, open-ended questions (poems, explanations, advice) with nothing in the prompt to copy.

Every request of a run is distinct, across concurrency levels and warm-ups too (`request_sets`), so a
method that learns from earlier requests (suffix decoding) never sees a repeat of the same prompt; it still
gains from what the requests share (a workload's JSON keys, its code idioms), as it would in real traffic.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

Messages = list[dict[str, str]]

FIRST = "Alice Maria James Olivia Daniel Sofia Ethan Priya Lucas Hannah Omar Chloe Mateo Yuki Noah Leila".split()
LAST = "Thompson Garcia Nguyen Okafor Schmidt Rossi Patel Kowalski Andersen Moreau Tanaka Silva Cohen Byrne".split()
CITIES = ["Boston", "Denver", "Seattle", "Austin", "Chicago", "Toronto", "Lisbon", "Rotterdam", "Osaka", "Dublin"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
COMPANIES = ["Northwind Logistics", "Bluefield Analytics", "Cedar & Pine Builders", "Helix Biotech",
             "Orchid Software", "Granite Peak Energy", "Silverline Foods", "Atlas Freight Group", "Lumen Health",
             "Redwood Capital Partners", "Kestrel Robotics", "Harbor Street Media"]


def _name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _date(rng: random.Random, year: int = 2024) -> str:
    return f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, {year}"


def _amount(rng: random.Random, low: int, high: int) -> str:
    return f"${rng.randint(low, high):,}.{rng.randint(0, 99):02d}"


# code_edit ---------------------------------------------------------------------------------------------------

NOUNS = ["order", "record", "event", "reading", "invoice", "payment", "ticket", "sample", "shipment", "session"]
VERBS = ["summarize", "aggregate", "group", "rank", "collect", "score", "filter", "reconcile"]
FIELDS = ["amount", "duration", "weight", "score", "latency", "quantity", "price", "distance"]
GROUPS = ["region", "category", "status", "owner", "source", "channel"]
RENAMES = {"total": "running_total", "count": "num_kept", "groups": "buckets", "kept": "selected",
           "skipped": "rejected", "stats": "shares"}


def _code(rng: random.Random) -> tuple[str, list[str]]:
    """A ~60-line function and the names of its locals that a rename may target."""
    noun, field, group = rng.choice(NOUNS), rng.choice(FIELDS), rng.choice(GROUPS)
    items, item, limit = f"{noun}s", noun, rng.choice(["threshold", "min_value", "cutoff"])
    top_k, digits, cut = rng.randint(3, 9), rng.randint(2, 4), rng.choice([0.05, 0.1, 0.2, 0.25])
    factor, cap = rng.choice([1, 2, 10, 100]), rng.choice([100, 500, 1000, 5000])
    verb = rng.choice(VERBS)
    lines = [
        f"def {verb}_{items}({items}, {limit}={rng.randint(1, 50)}, max_items={cap}, top_k={top_k}):",
        f'    """{verb.capitalize()} {items} by {group}, keeping those whose {field} exceeds the {limit}.',
        "",
        "    Args:",
        f"        {items}: a list of dicts, each with a '{field}' and a '{group}' key.",
        f"        {limit}: the smallest {field} kept; smaller ones are added to the total only.",
        "        max_items: stop after this many kept items.",
        f"        top_k: how many {group} names to return, largest share first.",
        "",
        "    Returns:",
        f"        A dict with the total, the number kept, the groups and the top {group} names.",
        '    """',
        f"    if not {items}:",
        '        return {"total": 0, "count": 0, "groups": {}, "top": []}',
        f"    if {limit} < 0:",
        f'        raise ValueError(f"{limit} must be non-negative, got {{{limit}}}")',
        "    total = 0",
        "    count = 0",
        "    groups = {}",
        "    kept = []",
        "    skipped = set()",
        "    stats = {}",
        f"    for index, {item} in enumerate({items}):",
        f"        if {item} is None:",
        "            skipped.add(index)",
        "            continue",
        f'        value = {item}.get("{field}", 0)',
        f"        if value > {limit}:",
        f"            kept.append({item})",
        "            count += 1",
        "        elif value < 0:",
        "            skipped.add(index)",
        "        else:",
        "            total += value",
        "        if count >= max_items:",
        "            break",
        f"    for {item} in kept:",
        f'        name = {item}.get("{group}", "unknown")',
        "        if name not in groups:",
        "            groups[name] = []",
        f"        groups[name].append({item})",
        "    index = 0",
        "    while index < len(kept):",
        f'        total += kept[index].get("{field}", 0) * {factor}',
        "        index += 1",
        "    for name, members in groups.items():",
        "        try:",
        "            share = len(members) / count",
        "        except ZeroDivisionError:",
        "            share = 0.0",
        f"        if share > {cut}:",
        f"            stats[name] = round(share, {digits})",
        "    ranked = sorted(stats.items(), key=lambda pair: pair[1], reverse=True)",
        "    top = [name for name, _ in ranked[:top_k]]",
        "    return {",
        '        "total": total,',
        '        "count": count,',
        '        "groups": groups,',
        '        "top": top,',
        '        "skipped": sorted(skipped),',
        "    }",
    ]
    if rng.random() < 0.5:  # variety: a comment or two, as real code has
        lines.insert(22, f"    # walk the {items} once: keep the large ones, total the rest")
    if rng.random() < 0.5:
        lines.insert(len(lines) - 9, f"    # the {group} names with the largest share of kept {items}")
    return "\n".join(lines), [n for n in RENAMES if len(re.findall(rf"\b{n}\b", "\n".join(lines[12:]))) >= 3]


def code_edit(rng: random.Random) -> Messages:
    code, names = _code(rng)
    if rng.random() < 0.5:
        old = rng.choice(names)
        task = f"Rename the local variable `{old}` to `{RENAMES[old]}` everywhere in this function."
    else:
        param = rng.choice(["verbose: bool = False", "strict: bool = False", "round_to: int = 2",
                            "default_group: str = \"unknown\""])
        task = (f"Add a keyword parameter `{param}` at the end of the signature and describe it in the "
                "docstring's Args section.")
    prompt = (f"{task} Return the full edited function in one ```python code block, with no explanation.\n\n"
              f"```python\n{code}\n```")
    return [{"role": "user", "content": prompt}]


# json_extract ------------------------------------------------------------------------------------------------

def json_extract(rng: random.Random) -> Messages:
    buyer, seller, other = rng.sample(COMPANIES, 3)
    buyer_rep, seller_rep, contact, bystander = (_name(rng) for _ in range(4))
    signed, first_due, ends, unrelated = _date(rng, 2024), _date(rng, 2024), _date(rng, 2026), _date(rng, 2023)
    installment, fee, setup, total = (_amount(rng, 900, 9000), _amount(rng, 50, 400), _amount(rng, 500, 5000),
                                      _amount(rng, 20000, 250000))
    service = rng.choice(["cloud hosting", "freight forwarding", "payroll processing", "equipment maintenance",
                          "data annotation", "security monitoring"])
    ref = f"{rng.choice(['AGR', 'CTR', 'SVC'])}-{rng.randint(2024, 2025)}-{rng.randint(1000, 99999):05d}"
    email = f"{contact.split()[0].lower()}.{contact.split()[1].lower()}@{seller.split()[0].lower()}.com"
    buyer_title = rng.choice(["CFO", "COO", "General Counsel"])
    seller_title = rng.choice(["Head of Sales", "Managing Director", "VP Partnerships"])
    document = "\n\n".join([
        f"On {signed}, {buyer}, based in {rng.choice(CITIES)}, signed a {service} agreement with {seller} of "
        f"{rng.choice(CITIES)}. The agreement was negotiated by {buyer_rep}, {buyer_title} at {buyer}, and "
        f"{seller_rep}, {seller_title} of {seller}.",
        f"Under its terms, {buyer} pays {installment} per month, the first installment due on {first_due}. A late "
        f"fee of {fee} applies to any installment more than {rng.choice([10, 15, 30])} days overdue. The total "
        f"contract value, including a one-time setup fee of {setup}, is {total}.",
        f"In a separate matter, {bystander} of {other} announced on {unrelated} that the company had closed its "
        f"office in {rng.choice(CITIES)}; that announcement is not part of this agreement.",
        f"The agreement runs until {ends}. Questions about invoices go to {contact} at {email}. Reference "
        f"number: {ref}.",
    ])
    keys = {"buyer": "the paying company", "seller": "the providing company", "signed_on": "the signing date",
            "buyer_representative": "who negotiated for the buyer", "monthly_installment": "the monthly amount",
            "first_payment_due": "date", "late_fee": "amount", "total_value": "amount", "end_date": "date",
            "contact_email": "email", "reference": "reference number"}
    listing = "\n".join(f"- {k}: {v}" for k, v in keys.items())
    prompt = (f"Read the document below and return only a JSON object with these keys, each value copied "
              f"verbatim from the document:\n{listing}\n\nDocument:\n\n{document}")
    return [{"role": "user", "content": prompt}]


# tool_loop ---------------------------------------------------------------------------------------------------

SYSTEM = ("You are a helpful assistant with tools. You call a tool with <tool_call>[...]</tool_call>; its result "
          "comes back in <tool_response> tags. Answer from the tool results, quoting their values exactly.")


def _flights(rng: random.Random) -> tuple[str, str, dict[str, Any], Any]:
    origin, dest = rng.sample(CITIES, 2)
    day = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    flights = [{"flight": f"{rng.choice(['UA', 'DL', 'AC', 'TP', 'KL'])} {rng.randint(100, 2999)}",
                "departs": f"{day}T{rng.randint(5, 21):02d}:{rng.choice(['00', '15', '30', '45'])}",
                "arrives": f"{day}T{rng.randint(8, 23):02d}:{rng.choice(['05', '20', '40', '55'])}",
                "stops": rng.choice([0, 0, 1]), "price_usd": rng.randint(89, 980), "seats_left": rng.randint(1, 9)}
               for _ in range(rng.randint(4, 6))]
    question = (f"Which flights go from {origin} to {dest} on {day}? List each with its flight number, times, "
                "stops and price, cheapest first.")
    return question, "search_flights", {"origin": origin, "destination": dest, "date": day}, {"flights": flights}


def _order(rng: random.Random) -> tuple[str, str, dict[str, Any], Any]:
    order_id = f"ORD-{rng.randint(100000, 999999)}"
    items = [{"sku": f"SKU-{rng.randint(10000, 99999)}", "name": rng.choice(
        ["USB-C cable 2m", "Wireless mouse", "27-inch monitor", "Laptop stand", "Mechanical keyboard",
         "Noise-cancelling headphones", "Webcam 1080p", "Desk lamp"]), "qty": rng.randint(1, 3),
        "unit_price": round(rng.uniform(9, 420), 2)} for _ in range(rng.randint(2, 4))]
    result = {"order_id": order_id, "customer": _name(rng), "status": rng.choice(["shipped", "in transit", "delayed"]),
              "carrier": rng.choice(["UPS", "DHL", "FedEx"]), "tracking_number": f"1Z{rng.randint(10**9, 10**10)}",
              "estimated_delivery": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", "items": items,
              "shipping_address": f"{rng.randint(1, 999)} {rng.choice(LAST)} Street, {rng.choice(CITIES)}"}
    question = (f"Where is my order {order_id}? Tell me its status, carrier, tracking number, delivery date and "
                "every item in it.")
    return question, "get_order", {"order_id": order_id}, result


def _forecast(rng: random.Random) -> tuple[str, str, dict[str, Any], Any]:
    city, days = rng.choice(CITIES), rng.randint(4, 6)
    start = rng.randint(1, 20)
    forecast = [{"date": f"2024-06-{start + i:02d}", "high_c": rng.randint(14, 33), "low_c": rng.randint(4, 16),
                 "condition": rng.choice(["sunny", "partly cloudy", "light rain", "thunderstorms", "overcast"]),
                 "wind_kmh": rng.randint(3, 45)} for i in range(days)]
    question = f"What's the weather in {city} for the next {days} days? Give me each day's high, low and conditions."
    return question, "get_forecast", {"city": city, "days": days}, {"city": city, "forecast": forecast}


def _customer(rng: random.Random) -> tuple[str, str, dict[str, Any], Any]:
    name = _name(rng)
    email = f"{name.replace(' ', '.').lower()}@example.com"
    tickets = [{"id": f"T-{rng.randint(1000, 9999)}", "subject": rng.choice(
        ["Cannot export reports", "Billing address change", "Two-factor login fails", "Invoice shows wrong VAT",
         "API rate limit too low", "Data import stuck"]), "status": rng.choice(["open", "pending", "closed"]),
        "opened": _date(rng)} for _ in range(rng.randint(2, 4))]
    result = {"name": name, "email": email, "plan": rng.choice(["Starter", "Team", "Business", "Enterprise"]),
              "customer_since": _date(rng, 2021), "tickets": tickets}
    question = (f"Look up the customer {email} and draft a short reply email to them that lists each of their "
                "tickets with its id, subject and status.")
    return question, "lookup_customer", {"email": email}, result


def tool_loop(rng: random.Random) -> Messages:
    question, tool, arguments, result = rng.choice([_flights, _order, _forecast, _customer])(rng)
    call = json.dumps([{"name": tool, "arguments": arguments}])
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "user", "content": f"<tool_response>\n{json.dumps(result, indent=2)}\n</tool_response>"}]


# chat (the control) ------------------------------------------------------------------------------------------

ADJECTIVES = ["a quiet", "an old", "a busy", "a forgotten", "a tiny", "a snowy", "a crowded", "a sunlit"]
PLACES = ["harbor", "library", "train station", "garden", "bakery", "lighthouse", "market", "mountain village",
          "bookshop", "orchard"]
ACTIVITIES = ["learn a new language", "start running", "save money", "sleep better", "cook healthy meals",
              "keep a journal", "learn to draw", "make new friends"]
CONTEXTS = ["as a busy parent", "on a student budget", "after moving to a new city", "in winter",
            "while working from home", "at the age of sixty"]
CONCEPTS = ["how airplanes fly", "why the sky is blue", "what a computer program is", "how vaccines work",
            "what inflation is", "how rainbows form", "why the moon has phases", "how a bill becomes law",
            "what photosynthesis is", "how the internet works", "why we have seasons", "what gravity is"]
AUDIENCES = ["a ten-year-old", "my grandmother", "a high-school student", "someone who has never heard of it"]
HEROES = ["a robot", "a lost dog", "a baker", "a young astronaut", "a shy dragon", "an old fisherman",
          "a street musician", "a detective cat"]
EVENTS = ["learns to paint", "finds a hidden door", "loses a bet", "wins a prize by accident",
          "meets a stranger on a train", "has to cross a river", "forgets their own name", "plants a tree"]
CHAT: list[tuple[str, list[list[str]]]] = [
    ("Write a short poem about {} {}.", [ADJECTIVES, PLACES]),
    ("What are some good ways to {} {}?", [ACTIVITIES, CONTEXTS]),
    ("Explain {} to {}.", [CONCEPTS, AUDIENCES]),
    ("Tell me a short story about {} who {}.", [HEROES, EVENTS]),
    ("Give me three ideas for a weekend in {} {}.", [ADJECTIVES, PLACES]),
]


def chat(rng: random.Random) -> Messages:
    template, pools = rng.choice(CHAT)
    return [{"role": "user", "content": template.format(*(rng.choice(pool) for pool in pools))}]


WORKLOADS: dict[str, Callable[[random.Random], Messages]] = {
    "code_edit": code_edit, "json_extract": json_extract, "tool_loop": tool_loop, "chat": chat}


def request_sets(workload: str, sizes: dict[str, int], seed: int = 0) -> dict[str, list[Messages]]:
    """Conversations of `workload`, `sizes[key]` for each key, all distinct from each other (across keys too), and
    the same for the same sizes and seed. Where a workload runs out of distinct conversations (the chat control has
    a few hundred), the rest repeat and a note is printed."""
    rng = random.Random(f"{workload}:{seed}")
    wanted = sum(sizes.values())
    pool: list[Messages] = []
    seen: set[str] = set()
    for _ in range(wanted * 50):
        if len(pool) == wanted:
            break
        messages = WORKLOADS[workload](rng)
        if (text := json.dumps(messages)) not in seen:
            seen.add(text)
            pool.append(messages)
    if len(pool) < wanted:
        print(f"note: {workload} has {len(pool)} distinct requests for {wanted} wanted; the rest repeat", flush=True)
        pool += [pool[i % len(pool)] for i in range(wanted - len(pool))]
    out, at = {}, 0
    for key, size in sizes.items():
        out[key], at = pool[at:at + size], at + size
    return out
