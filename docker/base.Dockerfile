# aerie's base image: a Debian bookworm root filesystem made by debootstrap (docker/build-images.sh
# makes and caches it), with Debian's Python 3.11. No registry is needed to build it.
FROM scratch
ADD rootfs.tar /
ENV LANG=C.UTF-8
CMD ["/bin/bash"]
