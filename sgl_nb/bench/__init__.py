"""`sgl-nb bench NAME`: each benchmark a module of this package, with its own flags."""
