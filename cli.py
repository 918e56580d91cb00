import click

@click.group()
def main():
    """graphopt"""
