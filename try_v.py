import re, pandas as pd
from builder.stages.scenarios.variety import shape
from builder.decontaminate import ngrams
STOP = set("a an the my me i to from of for in on at and or is are be this that it please can you could would will with all into your our we us".split())
def grams(text, ns, stop=False):
    m = shape(text).masked
    words = re.findall(r"[a-z0-9]+", m.casefold())
    if stop: words = [w for w in words if w not in STOP]
    out = set()
    for n in ns: out |= {tuple(words[i:i+n]) for i in range(len(words)-n+1)}
    return out
def J(a, b): return len(a & b) / len(a | b) if a | b else 0
df = pd.read_parquet('/work/wt-teacher8/runs/teacher-8/scenarios.parquet')
t7 = pd.read_parquet('/work/wt-teacher/runs/teacher-7/scenarios.parquet')
pairs = [
 ("P", "Move 300 cents from my checking account acc-1 to my savings account acc-2.", "Please transfer 300 cents from my checking account acc-1 into my savings account acc-2."),
 ("D", "Move 300 cents from my checking account acc-1 to my savings account acc-2.", "Freeze my savings account acc-2, I lost my card."),
 ("D", "Move 300 cents from my checking account acc-1 to my savings account acc-2.", "How much is in my savings account acc-2?"),
 ("P", "Hi, I'm Lucas Ferreira. Please cancel all my bookings.", "Hello, this is Lucas Ferreira, can you cancel all of my bookings please?"),
 ("P", "I'm member m1. Please lend me the book Emma by Jane Austen for 7 days.", "Member m1 here: I'd like to borrow Emma by Jane Austen for 7 days, please."),
 ("D", "I'm member m1. Please lend me the book Emma by Jane Austen for 7 days.", "I'm member m1. Please renew my loan of Emma by Jane Austen for 7 more days."),
 ("D", "I'm member m1. Please lend me the book Emma by Jane Austen for 7 days.", "I'm member m1. Please return the book Emma by Jane Austen today."),
]
texts = list(dict.fromkeys(list(df['task']) + list(t7['task'])))
for i in range(len(texts)):
    for j in range(i+1, len(texts)):
        pairs.append(("D", texts[i], texts[j]))
for ns, stop in (((3,), False), ((2,), False), ((1,), True), ((1,2), True), ((1,2,3), False)):
    print(ns, stop, [(k, round(J(grams(a, ns, stop), grams(b, ns, stop)), 2)) for k, a, b in pairs][:7], 'max D among real:', max(J(grams(a, ns, stop), grams(b, ns, stop)) for k, a, b in pairs[7:]))
