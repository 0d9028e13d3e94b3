"""The inference service both front-ends call: models, versions, validation."""
