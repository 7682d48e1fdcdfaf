"""
The book's tooling: the manuscript (book/*.md) rendered to HTML with every number read from results.json.

    render.py     book/*.md -> build/book/*.html: references, listings, math, figures, the glossary
    claims.py     {{claim: ...}}, {{verdict: ...|A/B}}, {{calc: ...}}: sentences that compare numbers, checked
    verdicts.py   a notebook's quick run judged beside the book's verdicts (beside())
    screens.py    the rendered pages in headless Chromium: screenshots, tables wider than the column
    readme.py     the README's headline table (`python -m lab.book.readme`)

    python -m lab.book [--check | --screens]     (__main__.py)
"""
