"""A model whose initialize raises."""


class TritonPythonModel:
    def initialize(self, args):
        raise ValueError("the weights file is missing")

    def execute(self, requests):
        return []
