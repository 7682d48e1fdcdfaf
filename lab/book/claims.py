"""
Verdicts the manuscript states in words, checked against the numbers they read.

A sentence that compares measured values ("earlier", "faster", "beats", "peaks near", "a tenth of") can
drift from its numbers on the next `make results`. So the manuscript either lets the result choose the
word, or guards the sentence with a claim that the build evaluates:

    its first token comes {{verdict: ch08.chunked.chunked.ttft_long_ms < ch08.chunked.whole.ttft_long_ms
    |earlier/later}} than prefilled whole                  -> "earlier" or "later", whichever is true
    H2O beats the sinks at 256. {{claim: ch07.evict.h2o.b256 < ch07.evict.sinks.b256}}
                                                           -> nothing; a false claim fails `make book`
    a perplexity of {{calc: 2.71828 ** ch07.ref_loss|.1f}}   -> "26.9", a number no experiment recorded
                                                              as such but the values determine

An expression reads values of results.json by their dotted keys and combines them with numbers,
+ - * / ** (a space around a minus: keys may contain hyphens, as in gpt2-random), comparisons (chained
ones too: 0.05 < a / b < 0.2), and, or, not, parentheses, abs(), min(), max(), and key[i] for one
element of a list value. Nothing else: no names, attributes or calls besides these.

A false claim, or one that reads a value that was not run, is a problem lab.book.render reports with the
chapter, the line and the sentence it guards, filled in with its numbers, so `make book` and the tests
fail naming it.
"""

import ast
import operator
import re

from lab.results import NOT_RUN, lookup

# {{claim: EXPR}}, {{verdict: EXPR|WORD_IF_TRUE/WORD_IF_FALSE}}, {{calc: EXPR|FORMAT}}; EXPR may span lines
CLAIM = re.compile(r"\{\{\s*(?P<kind>claim|verdict|calc)\s*:(?P<expr>[^{}|]+?)(?:\|(?P<words>[^{}]*?))?\s*\}\}")
KEY = re.compile(r"\b[A-Za-z_]\w*(?:\.(?:[\w-]*\w))+")  # a dotted key; "a.b - c" is a key minus c

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.Pow: operator.pow}
COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne}
FUNCTIONS = {"abs": abs, "min": min, "max": max}


class ClaimError(ValueError):
    """A claim that does not parse, reads a missing or unmeasured value, or is false."""


def keys(expr) -> list[str]:
    """The results keys an expression reads, in order."""
    return KEY.findall(expr)


def evaluate(expr, doc, source="results"):
    """The value of expr over doc's values (a bool for a comparison). ClaimError on anything else than the
    small language above, on a value that was not run, and on a key that does not resolve."""
    found = {}

    def name(m):
        found[f"_k{len(found)}"] = m[0]
        return f"_k{len(found) - 1}"

    try:
        tree = ast.parse(KEY.sub(name, " ".join(expr.split())), mode="eval")
    except SyntaxError as e:
        raise ClaimError(f"{expr.strip()!r} is not an expression: {e.msg}") from None

    def leaf(key):
        try:
            v = lookup(doc, key, source)["value"]
        except KeyError as e:  # ResultsKeyError: the message names the closest keys
            raise ClaimError(str(e)) from None
        if v == NOT_RUN:
            raise ClaimError(f"{key} was not run; a sentence cannot state a verdict on it")
        return v

    def ev(node):
        match node:
            case ast.Expression(body=body):
                return ev(body)
            case ast.Constant(value=v) if isinstance(v, int | float):
                return v
            case ast.Name(id=n) if n in found:
                return leaf(found[n])
            case ast.Subscript(value=ast.Name(id=n), slice=ast.Constant(value=i)) if n in found and type(i) is int:
                return leaf(found[n])[i]
            case ast.UnaryOp(op=ast.USub(), operand=x):
                return -ev(x)
            case ast.UnaryOp(op=ast.Not(), operand=x):
                return not ev(x)
            case ast.BinOp(op=op, left=a, right=b) if type(op) in BINARY:
                return BINARY[type(op)](ev(a), ev(b))
            case ast.BoolOp(op=ast.And(), values=xs):
                return all(ev(x) for x in xs)
            case ast.BoolOp(op=ast.Or(), values=xs):
                return any(ev(x) for x in xs)
            case ast.Compare(left=a, ops=ops, comparators=bs) if all(type(o) in COMPARE for o in ops):
                left = ev(a)
                for o, b in zip(ops, bs, strict=True):
                    right = ev(b)
                    if not COMPARE[type(o)](left, right):
                        return False
                    left = right
                return True
            case ast.Call(func=ast.Name(id=f), args=args, keywords=[]) if f in FUNCTIONS:
                return FUNCTIONS[f](*(ev(a) for a in args))
        shown = ast.unparse(node)
        for k, key in found.items():
            shown = shown.replace(k, key)
        raise ClaimError(f"{shown!r} in {expr.strip()!r}: a claim reads keys and numbers with + - * / **, "
                         f"comparisons, and/or/not, abs, min, max and key[i]")

    try:
        return ev(tree)
    except (TypeError, IndexError, ZeroDivisionError) as e:
        raise ClaimError(f"{expr.strip()!r}: {type(e).__name__}: {e}") from None


def verdict_words(words) -> tuple[str, str]:
    """"earlier/later" -> ("earlier", "later"); ClaimError unless it is two words (or phrases)."""
    parts = [w.strip() for w in (words or "").split("/")]
    if len(parts) != 2 or not all(parts):
        raise ClaimError(f"a verdict needs two words, the one for true first: |earlier/later, not |{words}")
    return parts[0], parts[1]


def fill(m, doc, source="results") -> str:
    """The text a CLAIM match renders to: nothing for a true claim, the chosen word for a verdict, the
    formatted number for a calc."""
    value = evaluate(m["expr"], doc, source)
    if m["kind"] == "calc":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ClaimError(f"calc {m['expr'].strip()!r} is {value!r}, not a number")
        try:
            return format(value, (m["words"] or ".3g").strip())
        except ValueError as e:
            raise ClaimError(f"calc {m['expr'].strip()!r}: format {m['words']!r}: {e}") from None
    if m["kind"] == "verdict":
        yes, no = verdict_words(m["words"])
        if not isinstance(value, bool):
            raise ClaimError(f"verdict {m['expr'].strip()!r} is {value!r}, not a comparison")
        return yes if value else no
    if m["words"] is not None:
        raise ClaimError(f"a claim renders nothing; |{m['words']} belongs to a verdict")
    if value is not True:
        raise ClaimError(f"{m['expr'].strip()!r} is {value!r}" if not isinstance(value, bool)
                         else f"{m['expr'].strip()!r} is false")
    return ""


SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z*_`{(\[])")


def sentence(text, start, end, keep=False) -> str:
    """The sentence a claim at text[start:end] guards: the one it ends (a claim right after a full stop)
    or the one it sits in, within its paragraph, on one line. With keep, the verdicts and calcs in it (its
    own included) stay as markup, for a renderer to fill in; otherwise every claim, verdict and calc goes."""
    drop = (lambda m: "" if m["kind"] == "claim" else m[0]) if keep else ""
    own = CLAIM.sub(drop, text[start:end])
    para_start = text.rfind("\n\n", 0, start) + 2 if "\n\n" in text[:start] else 0
    para_end = text.find("\n\n", end)
    para_end = len(text) if para_end < 0 else para_end
    before, after = CLAIM.sub(drop, text[para_start:start]), text[end:para_end]   # claims stacked after one sentence
    starts = [m.end() for m in SENTENCE_END.finditer(before)]
    if re.search(r"[.!?]\s*$", before):  # the claim follows the sentence it guards
        head = before.rstrip()
        starts = [s for s in starts if s < len(head)]
        return " ".join(CLAIM.sub(drop, head[starts[-1] if starts else 0:]).split())
    head = before[starts[-1] if starts else 0:]
    tail = SENTENCE_END.split(after, maxsplit=1)[0]
    return " ".join(CLAIM.sub(drop, head + own + tail).split())
