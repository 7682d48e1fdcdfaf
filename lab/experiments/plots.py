"""What every figure of the book does last: lay it out, save it as a PNG when a path is given."""


def finish(fig, path=None, **layout):
    """tight_layout(**layout), then savefig(path) at 120 dpi if path; returns the figure (notebooks show it)."""
    fig.tight_layout(**layout)
    if path:
        fig.savefig(path, dpi=120)
    return fig
