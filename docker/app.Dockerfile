# syntax=docker/dockerfile:1
# Your app in the image: a layer on the fedgrid image (docker/Dockerfile) that adds an app
# directory, as `fedgrid new NAME` writes it, at /opt/app/NAME on the import path. The
# context is the app's own folder:
#
#   docker build -f docker/Dockerfile -t fedgrid .                                 # once: fedgrid itself
#   docker build -f docker/app.Dockerfile --build-arg APP=myapp -t myfed:1 myapp   # your app on it
#
# Then FEDGRID_IMAGE=myfed:1 in docker/.env, `--model myapp.app:model` in global.yaml's
# command and `--app myapp.app:client` in client.yaml's (docs/multisite.rst). Your app's
# own dependencies: a `RUN pip install ...` line below (the image's pip is /opt/venv's).

ARG FEDGRID_IMAGE=fedgrid:latest
FROM ${FEDGRID_IMAGE}

# The app's package name: what --app and --model import (myapp.app:client).
ARG APP=myapp
COPY --chown=fedgrid:fedgrid . /opt/app/${APP}
ENV PYTHONPATH=/opt/app
