"""ninfer command line (typer + rich); heavy imports happen inside commands."""
