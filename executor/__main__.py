from executor.client.cli import run

run()
