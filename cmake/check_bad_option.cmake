# Runs PROGRAM with the arguments after `--` and checks that it refused them cleanly: exit
# status 2, nothing on stdout, exactly one line on stderr starting with "NAME: " and containing
# OPTION. Usage:
#   cmake -DPROGRAM=<exe> -DNAME=<name> -DOPTION=<text> -P check_bad_option.cmake -- <args...>
set(args "")
set(after_separator FALSE)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE ${last})
  if(after_separator)
    list(APPEND args "${CMAKE_ARGV${i}}")
  elseif(CMAKE_ARGV${i} STREQUAL "--")
    set(after_separator TRUE)
  endif()
endforeach()
string(REPLACE ";" " " shown "${args}")

execute_process(COMMAND "${PROGRAM}" ${args}
  RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 50)
message(STATUS "${NAME} ${shown}\n  status: ${status}\n  stderr: ${err}")
if(NOT status STREQUAL "2")
  # A signal or timeout reads as text ("Child aborted", "Process terminated due to timeout").
  message(FATAL_ERROR "expected exit status 2 for a bad option, got '${status}'")
endif()
if(NOT out STREQUAL "")
  message(FATAL_ERROR "expected nothing on stdout, got:\n${out}")
endif()
if(NOT err MATCHES "^[^\n]*\n$")
  message(FATAL_ERROR "expected exactly one line on stderr")
endif()
string(FIND "${err}" "${NAME}: " at)
if(NOT at EQUAL 0)
  message(FATAL_ERROR "the message does not start with '${NAME}: '")
endif()
string(FIND "${err}" "${OPTION}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the message does not name '${OPTION}'")
endif()
