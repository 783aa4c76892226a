"""`fluidps serve-model EXPORT_DIR`: answer predictions over HTTP from a model's exports."""

from __future__ import annotations

import click

from fluidps.cli.common import fail
from fluidps.errors import Error


@click.command("serve-model")
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8500, show_default=True)
@click.option(
    "--poll",
    "poll_s",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between looks for a new version.",
)
def serve_model(export_dir: str, host: str, port: int, poll_s: float) -> None:
    """Serve the newest version of EXPORT_DIR (fluidps.io.Exporter's): POST /predict
    with {"inputs": {name: nested lists}} answers {"version": N, "outputs": {...}};
    GET /healthz, GET /metrics (Prometheus). Each new version (a base, or a delta on
    the one served) is checked and swapped in whole: no request sees half of one, and
    a damaged version is refused while the old one goes on serving. Needs the serve
    extra: pip install "fluidps[serve]"."""
    try:
        import uvicorn

        from fluidps.serving.http import create_app
        from fluidps.serving.predictor import Predictor
    except ImportError as e:
        fail(f'serve-model needs the serve extra (pip install "fluidps[serve]"): {e}')
    try:
        predictor = Predictor(export_dir)
    except Error as e:
        fail(str(e))
    click.echo(f"serving version {predictor.version} of {export_dir} on http://{host}:{port}")
    uvicorn.run(create_app(predictor, poll_s), host=host, port=port, log_level="warning")
