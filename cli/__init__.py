"""The `fluidps` command line: inspect, dot, transpile, place, calibrate, launch, serve,
keys, secret, data, stream, checkpoint, k8s.

Every command turns bad input into one line on stderr and exit status 2;
a check that finds problems exits with 1.

May import: anything
"""

from __future__ import annotations

import click

from fluidps.cli.calibrate_cmd import calibrate
from fluidps.cli.checkpoint_cmd import checkpoint
from fluidps.cli.data_cmd import data
from fluidps.cli.k8s_cmd import k8s
from fluidps.cli.launch_cmd import launch
from fluidps.cli.place_cmd import place
from fluidps.cli.program_cmds import dot, inspect
from fluidps.cli.serve_cmd import keys, secret, serve
from fluidps.cli.serve_model_cmd import serve_model
from fluidps.cli.stream_cmd import stream
from fluidps.cli.transpile_cmd import transpile


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fluidps", prog_name="fluidps")
def main() -> None:
    """fluidps: Fluid-style programs, local execution and parameter-server training."""


main.add_command(inspect)
main.add_command(dot)
main.add_command(transpile)
main.add_command(place)
main.add_command(calibrate)
main.add_command(launch)
main.add_command(serve)
main.add_command(serve_model)
main.add_command(keys)
main.add_command(secret)
main.add_command(data)
main.add_command(stream)
main.add_command(checkpoint)
main.add_command(k8s)
