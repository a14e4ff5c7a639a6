"""The copy workload of `sgl-nb bench copy`: requests whose answer repeats its prompt.

Two kinds, as users run them: fields quoted verbatim out of a document (an invoice, a
maintenance report, a job posting; 300-600 tokens each, 4-5 fields), and a code snippet
returned whole with one name changed. Each request is a user turn in the model's chat
template, built once as token ids so that every engine gets the same prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

INVOICE = """\
NORTHWIND MARINE SUPPLY CO.
Unit 14, Harbourside Trading Estate, 221 Quay Road, Portsmouth PO1 3LT, United Kingdom
VAT registration GB 318 4471 92

INVOICE No. NMS-2024-08817
Invoice date: 12 March 2024
Payment due: 11 April 2024 (30 days net)
Customer account: ACC-55102

Bill to:
Mrs. Eleanor Whitcombe-Hayes
Whitcombe Sailing School Ltd.
The Old Boathouse, 7 Ferry Lane, Lymington SO41 9AX

Ship to:
Whitcombe Sailing School Ltd., Berth C-22, Lymington Yacht Haven, King's Saltern Road,
Lymington SO41 3QD

Order reference: PO-WSS-1193 (placed by telephone on 4 March 2024, taken by D. Okafor)

Items:
1. Stainless steel snap shackle, 12 mm, part SS-SNP-12, quantity 24, unit price 8.40,
   line total 201.60
2. Double-braid polyester rope, 10 mm, white with blue fleck, 50 m reel, part DB-10-WB50,
   quantity 3, unit price 64.95, line total 194.85
3. Self-inflating lifejacket, 150N, adult universal, part LJ-150-AU, quantity 12, unit
   price 47.50, line total 570.00
4. Marine-grade silicone sealant, clear, 290 ml cartridge, part SIL-290-CL, quantity 18,
   unit price 6.25, line total 112.50

Subtotal: 1,078.95 GBP
Delivery (pallet, two-day service): 35.00 GBP
VAT at 20%: 222.79 GBP
Total due: 1,336.74 GBP

Payment by bank transfer to Northwind Marine Supply Co., sort code 40-11-62, account
71829304, quoting the invoice number. Goods remain the property of Northwind Marine Supply
Co. until paid in full. Queries about this invoice: accounts@northwind-marine.example,
telephone 023 9287 4410, Monday to Friday, 8:30 to 17:00.
"""

INCIDENT = """\
MAINTENANCE REPORT - LINE 3 BOTTLING HALL
Report ID: MR-2291-B
Site: Calder Valley Soft Drinks, Plant 2, Brearley Mill Road, Hebden Bridge HX7 6LN
Reported by: Tomasz Wieczorek, shift engineer (night shift)
Date and time of fault: 23 October 2024, 02:47
Equipment: Krones Modulfill HRS filler, serial number KMF-77410-2016, 72 filling valves

Summary of fault:
At 02:47 the filler stopped on alarm E-1147 "bowl level low" while running 500 ml PET
bottles of sparkling orange at 24,000 bottles per hour. The operator, Priya Raman, reset
the alarm twice; both times the machine stopped again within four minutes. Product
pressure at the bowl inlet read 2.1 bar against the set point of 3.4 bar.

Investigation:
The inlet strainer upstream of the product valve PV-12 was found partly blocked with
orange pulp fibre. The strainer was last cleaned on 9 October 2024, eight days later than
the schedule in work instruction WI-F-031 requires. The level probe LT-3 was tested with a
calibrated reference and read within 0.5% of true level, so the alarm was genuine.

Actions taken:
1. Line stopped and product valve PV-12 isolated at 03:05.
2. Strainer removed, cleaned and refitted with a new EPDM gasket, part number
   GSK-EPDM-80.
3. Filler bowl flushed with hot water at 85 degrees Celsius for 15 minutes.
4. Line restarted at 04:20; bowl inlet pressure steady at 3.4 bar for the rest of the
   shift.

Production lost: 1 hour 33 minutes, about 37,200 bottles.
Root cause: missed strainer cleaning; the cleaning task was not carried over when the
maintenance planner changed from paper cards to the new CMMS in September.
Follow-up: add the strainer cleaning to the CMMS as a weekly task (owner: Gareth Sowerby,
maintenance planner, due 30 October 2024) and check the other 41 migrated tasks.
"""

JOB = """\
Position: Senior Data Engineer (Streaming Platforms)
Company: Fjordlight Analytics AS
Location: Tollbugata 17, 0152 Oslo, Norway (hybrid: three days a week in the office)
Reference: FLA-DE-0427
Closing date for applications: 15 January 2025
Salary range: NOK 780,000 - 910,000 per year, plus pension and a yearly training budget
Hiring manager: Ingrid Solheim-Bakke, Head of Data Platform

About us:
Fjordlight Analytics builds forecasting tools for hydropower producers in Norway, Sweden
and Scotland. Our models read river gauges, snow-pack sensors and weather forecasts every
ten minutes and tell plant operators how much water will reach each reservoir over the
next fourteen days. Around forty people work here, twelve of them on the data platform.

What you will do:
- Own the ingestion pipelines that bring in about 2.3 billion sensor readings a month
  through Apache Kafka and Apache Flink into our lakehouse on Apache Iceberg.
- Replace the nightly batch jobs that rebuild the reservoir features with incremental
  streaming jobs, with clear service levels for late and missing data.
- Work with the forecasting team to make training data reproducible: every model run must
  be traceable to the exact snapshot of inputs it used.
- Mentor two junior engineers and take part in a light on-call rotation (one week in
  six, paid separately).

What we are looking for:
- At least five years of building data pipelines in production, two of them on streaming
  systems (Kafka, Flink, Spark Structured Streaming or similar).
- Strong Python or Scala, and good SQL.
- Experience with schema evolution and with testing data pipelines.
- Norwegian is not required; our working language is English.

How to apply:
Send a CV and a short note on a pipeline you are proud of to careers@fjordlight.example,
with the reference FLA-DE-0427 in the subject line. Interviews take place in the week of
27 January 2025.
"""

# (name, document, fields asked for, most new tokens)
EXTRACTIONS = [
    ("invoice", INVOICE, ["Invoice number", "Bill-to company", "Ship-to address",
                          "Payment due", "Total due"], 160),
    ("maintenance", INCIDENT, ["Report ID", "Equipment", "Reported by", "Root cause"], 160),
    ("job posting", JOB, ["Company", "Location", "Reference", "Closing date",
                          "Salary range"], 160),
]

RESERVOIR_PY = '''\
def summarize_levels(readings, capacity_m3, alert_fraction=0.9):
    """Daily mean level per reservoir, and the days above the alert fraction."""
    daily = {}
    for reading in readings:
        key = (reading.reservoir, reading.timestamp.date())
        daily.setdefault(key, []).append(reading.volume_m3)
    summary = {}
    for (reservoir, day), volumes in sorted(daily.items()):
        mean_volume = sum(volumes) / len(volumes)
        fraction = mean_volume / capacity_m3[reservoir]
        entry = summary.setdefault(reservoir, {"days": [], "alerts": []})
        entry["days"].append((day, round(fraction, 3)))
        if fraction >= alert_fraction:
            entry["alerts"].append(day)
    return summary
'''

INVOICE_JS = '''\
function invoiceTotals(lines, vatRate, delivery) {
  let subtotal = 0;
  for (const line of lines) {
    if (line.quantity <= 0) {
      throw new Error(`bad quantity on ${line.part}`);
    }
    line.total = Math.round(line.quantity * line.unitPrice * 100) / 100;
    subtotal += line.total;
  }
  const vat = Math.round((subtotal + delivery) * vatRate * 100) / 100;
  return {
    subtotal: subtotal,
    delivery: delivery,
    vat: vat,
    total: Math.round((subtotal + delivery + vat) * 100) / 100,
  };
}
'''

# (name, snippet, language, old name, new name, most new tokens)
EDITS = [
    ("rename in Python", RESERVOIR_PY, "Python", "fraction", "fill_ratio", 320),
    ("rename in JavaScript", INVOICE_JS, "JavaScript", "subtotal", "netAmount", 320),
]


@dataclass
class CopyRequest:
    name: str
    kind: str  # "extract" or "edit"
    ids: list[int]
    max_tokens: int


def extraction_message(document: str, fields: list[str]) -> str:
    listed = "\n".join(f"{field}:" for field in fields)
    return ("Copy the following fields out of the document below, each value exactly as it is "
            "written there, one field a line in the form 'Field: value'.\n\n"
            f"{listed}\n\nDocument:\n{document}")


def edit_message(code: str, language: str, old: str, new: str) -> str:
    return (f"Rename the variable `{old}` to `{new}` in this {language} code. Change nothing "
            f"else, and answer with the whole code.\n\n```\n{code}```")


def copy_requests(tok) -> list[CopyRequest]:
    """The workload as token ids in `tok`'s chat template, extractions first."""
    def ids(message: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": message}],
                                                  tokenize=False, add_generation_prompt=True))

    requests = [CopyRequest(name, "extract", ids(extraction_message(doc, fields)), n)
                for name, doc, fields, n in EXTRACTIONS]
    requests += [CopyRequest(name, "edit", ids(edit_message(code, lang, old, new)), n)
                 for name, code, lang, old, new, n in EDITS]
    return requests
