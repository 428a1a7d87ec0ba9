"""Variety of task texts (builder/stages/scenarios/variety.py): near-duplicates dropped, template repeats told
apart from them, copies of the seed request found; on tasks a capable model wrote (runs teacher-7 and teacher-8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.stages.scenarios.variety import (
    TaskIndex,
    copies_seed,
    near_duplicates,
    repeats,
    same_values,
    shape,
    similarity,
    template_repeats,
)

STATES = Path(__file__).parent / "fixtures" / "states"
CLAIMS_TASK = json.loads((STATES / "teacher8_claims.json").read_text())["task"]
DENTAL_TASK = json.loads((STATES / "teacher8_dental.json").read_text())["task"]
# Distinct tasks a capable model wrote (teacher-7 / teacher-8), one per scenario.
CAPABLE = [
    DENTAL_TASK,
    CLAIMS_TASK,
    "Hi, I'm Daniel Whitmore (born 1961-09-02). I saw Dr. Anand Mehta earlier this month for my arrhythmia and need "
    'a follow-up with him on April 22 at 9:00 am — please book it with the reason "arrhythmia follow-up". Also, my '
    "phone number changed: please update it to +1-310-555-0499.",
    "Hi, this is the claims desk. On claim CLM-5001, please attach the file rear_bumper_damage.jpg as an invoice, and "
    "delete document DOC-303. Then update policyholder PH-102's record: email d.okafor@example.net and mailing "
    "address 2218 W Belmont Ave, Chicago, IL 60618. Finally, show me all our policyholders and list every travel "
    "policy we have on file.",
    "Hi, this is the front desk at the clinic. Could you pull up all appointments for patient P-1 and give me the "
    "full details of her upcoming scheduled one (time, doctor and clinic)? Also, please mark appointment A-5 as "
    "completed, that patient just finished her annual physical.",
    "Hi, I'm Rajesh Iyer. My doctor says I can restart my atorvastatin, which is currently paused, but I should take "
    "it at 20:00 instead of 21:00 from now on. Please move it to 20:00, resume it, and set up my reminder for "
    "tonight (2025-06-18).",
    "I'm Gloria Whitfield, patient ID P-201. Please move my echocardiogram results review with Dr. Rebecca Alvarez "
    "from this Wednesday (June 11) at 9:00 to Thursday, June 12 at 2:00 pm. Also book me with Dr. Mei Tanaka, the "
    "dermatology doctor in Los Angeles, in her June 18 slot at 3:40 pm for an itchy rash on my forearm.",
    "Hi, I'm Samuel Novak, patient P-3. Please move my dental appointment with Dr. Liam O'Connell for my cracked "
    "lower molar to the 8:00 AM slot on Wednesday, June 11. Also book me a virtual visit with Dr. Grace Oyelaran on "
    "Thursday, June 12 at 6:00 PM for stress and trouble sleeping.",
    "Hi, this is Maria Alvarez. Please cancel my appointment A-501. Also, my husband's annual physical is "
    "appointment A-504 — can you tell me which doctor that's with and what openings that same doctor has for a "
    "video visit, like the one I just cancelled? Don't book anything yet, I just want to see the options.",
]
MOVE = "Move 300 cents from my checking account acc-1 to my savings account acc-2."


def test_values_are_masked_ids_numbers_emails_quotes_and_names():
    task = shape(DENTAL_TASK)
    assert {"lucas ferreira", "lucas.ferreira@example.com", "dr. rebecca liang", "9:00", "april"} <= task.values
    assert "Lucas" not in task.masked and "9:00" not in task.masked and "I'm" in task.masked
    assert "teeth-whitening" in task.masked  # an ordinary hyphenated word is not a value
    claims = shape(CLAIMS_TASK)
    assert {"abc123", "klm457", "2022-12-31", "$3,125.00", "bodyshop_estimate_2023-01-19.pdf"} <= claims.values
    assert shape('Set the reason to "arrhythmia follow-up" please').values == {"arrhythmia follow-up"}


def test_a_capable_models_run_with_each_task_twice_keeps_one_of_each():
    texts = CAPABLE + CAPABLE[::-1]  # the teacher-8 release held each task twice (both modes)
    dropped = near_duplicates(texts)
    assert dropped == list(range(len(CAPABLE), 2 * len(CAPABLE)))
    assert not template_repeats(CAPABLE)  # different kinds of tasks


def test_light_rewording_of_the_same_request_is_a_near_duplicate():
    reworded = "Please transfer 300 cents from checking account acc-1 into savings account acc-2."
    assert similarity(shape(MOVE), shape(reworded)) >= 0.6 and same_values(shape(MOVE), shape(reworded))
    assert near_duplicates([MOVE, reworded]) == [1]
    sentence_swap = (
        "Also book me a virtual consultation with Dr. Liang this Friday, April 11 at 4:00 pm, and note that I want "
        "to ask about teeth-whitening options. Hi, I'm Lucas Ferreira (lucas.ferreira@example.com). Please move my "
        "routine cleaning with Dr. Rebecca Liang from tomorrow morning to this Thursday, April 10 at 9:00 am."
    )
    assert near_duplicates([DENTAL_TASK, sentence_swap]) == [1]


@pytest.mark.parametrize(
    "other",
    [
        "Freeze my savings account acc-2, I lost my card.",
        "How much is in my savings account acc-2?",
        "Show me the last five transfers out of acc-1.",
    ],
)
def test_another_request_on_the_same_records_is_not_a_duplicate(other):
    assert near_duplicates([MOVE, other]) == [] and template_repeats([MOVE, other]) == []


def test_the_same_request_about_other_records_is_a_template_repeat_not_a_duplicate():
    ada = (
        "I'm Ada Lovelace, customer c1. Move 30.00 from my checking account acc-1 to my savings account acc-2, "
        "then freeze the savings account."
    )
    grace = (
        "I'm Grace Hopper, customer c2. Move 45.50 from my checking account acc-3 to my savings account acc-5, "
        "then freeze the savings account."
    )
    found = repeats([ada, grace])
    assert [(r.index, r.earlier, r.kind) for r in found] == [(1, 0, "template_repeat")]
    assert near_duplicates([ada, grace]) == [] and template_repeats([ada, grace]) == [1]
    # the same wording with the same records (only the amount changed) is the same task
    assert near_duplicates([ada, ada.replace("30.00", "31.00")]) == [1]


def test_bookings_of_two_customers_are_template_repeats():
    texts = [
        "Hi, I'm Lucas Ferreira. Please cancel all my bookings.",
        "Hi, I'm Olivia Bennett. Please cancel all my bookings.",
    ]
    assert template_repeats(texts) == [1] and near_duplicates(texts) == []


def test_tasks_of_earlier_runs_count_and_are_reported_by_negative_index():
    found = repeats([CAPABLE[4], MOVE], earlier=[MOVE, CAPABLE[0]])
    assert [(r.index, r.earlier, r.kind) for r in found] == [(1, -1, "near_duplicate")]
    assert near_duplicates([MOVE], earlier=[MOVE]) == [0]


def test_a_near_duplicate_is_not_indexed_but_a_template_repeat_is():
    a = "Hi, I'm Lucas Ferreira. Please cancel all my bookings."
    b = "Hi, I'm Olivia Bennett. Please cancel all my bookings."
    found = repeats([a, a, b, b])
    assert [(r.index, r.earlier, r.kind) for r in found] == [
        (1, 0, "near_duplicate"),
        (2, 0, "template_repeat"),
        (3, 2, "near_duplicate"),  # the closest: the same records
    ]


def test_short_and_empty_texts():
    assert near_duplicates(["Help.", "Help!", "", ""]) == [1]  # empty texts have nothing to compare
    index = TaskIndex()
    assert index.check("anything") is None


def test_copying_the_seed_request():
    seed = "Check the status of an insurance claim filed on 2022-12-31 with reference number ABC123."
    assert copies_seed(CLAIMS_TASK, [seed])  # its two values come back: claim ABC123 filed on 2022-12-31
    assert copies_seed("Please check the status of an insurance claim filed on 2023-02-01 with reference number "
                       "ZZZ999, thanks.", [seed])  # fmt: skip
    dental_seed = "Schedule a virtual consultation with a dentist in San Francisco."
    assert not copies_seed(DENTAL_TASK, [dental_seed])  # shares "virtual consultation", nothing more
    assert copies_seed("Schedule a virtual consultation with a dentist in Oakland for next week.", [dental_seed])
    assert not copies_seed("Find me a dentist in San Francisco.", [dental_seed])  # one value alone is not a copy
    assert not copies_seed(CLAIMS_TASK, [])
