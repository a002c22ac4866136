"""Arithmetic word problems with checkable answers, in GSM8K's format.

Each problem is one addition or subtraction of numbers below 1000 told as a short story
("Q: ... A: ... #### 632").  The answer works the sum column by column, right to left,
in a fixed-width notation before stating the result, the way GSM8K answers show their
calculation before the final ``#### N`` line::

    Q: Ana has 347 apples. She buys 285 more. How many apples does Ana have now?
    A: 7+5+0=12, 4+8+1=13, 3+2+1=06. 347 + 285 = 632.
    #### 632

A column ``a+b+c=XY`` adds the column's digits and the carry in (``c``) and writes the
carry out ``X`` and the digit ``Y``; a subtraction column ``a-b-c=XY`` subtracts the
digit and the borrow in and writes the borrow out ``X`` and the digit ``Y`` (``4-8-0=16``:
borrow 1, digit 6). Every column has the same width, so each step's inputs sit at fixed
distances from it: a small model learns the rule instead of memorising sums.

Problems are a pure function of ``(seed, index)``: training draws from seeds it names,
the held-out set (``held_out``) from a seed training never uses, and a problem's
operands and story decide each other only through the generator.
"""

from __future__ import annotations

import dataclasses
import random
import re

NAMES = ("Ana", "Ben", "Cai", "Dora", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena")
ITEMS = ("apples", "books", "coins", "pens", "cards", "stamps", "shells", "marbles", "stickers",
         "cookies", "flowers", "pencils")
# (story, operator): {n} a name, {p} its pronoun, {it} the items, {a} {b} the operands.
STORIES = (
    ("{n} has {a} {it}. {P} buys {b} more. How many {it} does {n} have now?", "+"),
    ("{n} had {a} {it} and found {b} more. How many {it} does {n} have?", "+"),
    ("A box holds {a} {it} and a bag holds {b} {it}. How many {it} are there in all?", "+"),
    ("{n} has {a} {it}. {P} gives {b} to a friend. How many {it} does {n} have left?", "-"),
    ("A shop had {a} {it}. It sold {b} of them. How many {it} are left in the shop?", "-"),
    ("{n} collected {a} {it} and lost {b}. How many {it} does {n} still have?", "-"),
)
PRONOUNS = {"Ana": "She", "Ben": "He", "Cai": "He", "Dora": "She", "Eli": "He", "Fay": "She",
            "Gus": "He", "Hana": "She", "Ivan": "He", "Jade": "She", "Kai": "He", "Lena": "She"}
HELD_OUT_SEED = 1_000_003  # training seeds are small integers; this one is never trained on
ANSWER = re.compile(r"####\s*(-?\d+)")


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str  # the story
    work: str  # the column-by-column working and the stated result
    answer: int

    @property
    def prompt(self) -> str:
        """The completion prompt: the model continues with `completion`."""
        return f"Q: {self.question}\nA:"

    @property
    def completion(self) -> str:
        return f" {self.work}\n#### {self.answer}"

    @property
    def reply(self) -> str:
        """The assistant's message when the question comes as a chat message."""
        return f"{self.work}\n#### {self.answer}"


def columns(a: int, b: int, op: str) -> str:
    """The fixed-width working of ``a op b`` over three columns, ones first."""
    steps, carry = [], 0
    for k in range(3):
        x, y = a // 10 ** k % 10, b // 10 ** k % 10
        s = x + y + carry if op == "+" else x - y - carry
        out, digit = (divmod(s, 10) if op == "+" else (1, s + 10) if s < 0 else (0, s))
        steps.append(f"{x}{op}{y}{op}{carry}={out}{digit}")
        carry = out
    return ", ".join(steps)


def problem(rng: random.Random) -> Problem:
    story, op = rng.choice(STORIES)
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    if op == "-" and b > a:
        a, b = b, a
    name = rng.choice(NAMES)
    question = story.format(n=name, P=PRONOUNS[name], it=rng.choice(ITEMS), a=a, b=b)
    answer = a + b if op == "+" else a - b
    return Problem(question, f"{columns(a, b, op)}. {a} {op} {b} = {answer}.", answer)


def problems(seed: int, n: int) -> list[Problem]:
    rng = random.Random(seed)
    return [problem(rng) for _ in range(n)]


def held_out(n: int) -> list[Problem]:
    """The evaluation problems (the first ``n`` of the held-out stream)."""
    return problems(HELD_OUT_SEED, n)


def extract(text: str) -> int | None:
    """The final answer of a generated reply (the number after ``####``), as GSM8K scores."""
    found = ANSWER.findall(text)
    return int(found[-1]) if found else None
